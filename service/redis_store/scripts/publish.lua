-- The one place versions advance: check current == new - 1, store, bump, announce, trim.
-- KEYS: meta, placement:<new>, announce, placement:<new - kept>; ARGV: new, placement, maxlen.
-- Returns the version found before (new - 1 on success), or -1 when the deployment is gone.
local cur = redis.call('HGET', KEYS[1], 'version')
if not cur then return -1 end
cur = tonumber(cur)
if cur + 1 ~= tonumber(ARGV[1]) then return cur end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'version', ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'version', ARGV[1])
redis.call('DEL', KEYS[4])
return cur
