-- KEYS: meta, deployment, placement:<v>, announce, seen; ARGV: version, deployment, placement,
-- maxlen, now, only_if_newer, generation (the deployment's create time: a re-created deployment
-- gets a new one, a restored one keeps it). Liveness counts from now on a create, and on a
-- write-back into a store that lost the seen times. Returns 1 if written.
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if ARGV[6] == '0' and redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if ARGV[6] == '1' and cur >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], ARGV[3])
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'reports', 0, 'planned_reports', 0, 'planned_at', ARGV[5], 'gen', ARGV[7])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'version', ARGV[1])
if ARGV[6] == '0' then redis.call('DEL', KEYS[5]) end
redis.call('HSETNX', KEYS[5], 'start', ARGV[5])
return 1
