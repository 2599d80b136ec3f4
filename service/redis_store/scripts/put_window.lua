-- KEYS: windows, meta, wal; ARGV: replica, blob, then the wal ids folded into the blob. A
-- replica that has not yet noticed a deletion must not re-create the windows key of a deleted
-- deployment.
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if #ARGV > 2 then redis.call('XDEL', KEYS[3], unpack(ARGV, 3)) end
return 1
