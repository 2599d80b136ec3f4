-- Liveness times, each kept only where later than the stored one (replicas flush in any order).
-- KEYS: seen, meta; ARGV: rank1, time1, rank2, time2, … Returns -1 when the deployment is gone.
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
for i = 1, #ARGV, 2 do
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if tonumber(ARGV[i + 1]) > old then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
return 1
