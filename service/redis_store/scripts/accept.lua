-- Accepts a batch of reports only together with its counts: KEYS: seq, meta, wal; ARGV: the
-- write-ahead blob of the batch's sums, the MINID below which old entries are trimmed, then
-- rank1, seq1, rank2, seq2, … Seqs compare as Lua doubles, exact below 2^53 (the servicer
-- rejects larger). If every pair is new: marks the seqs, counts them, appends the blob to the
-- wal stream and returns the entry's id (a string: the flags are all 1, and a reply of one
-- string is what the replica's loop parses fastest); otherwise writes nothing and returns
-- {0, flags} (one 0/1 per pair, in order), and the caller retries with the new ones' sums. -1
-- when the deployment is gone.
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
local last = {}
local out = {}
local all = 1
for i = 3, #ARGV, 2 do
  local r = ARGV[i]
  if last[r] == nil then last[r] = tonumber(redis.call('HGET', KEYS[1], r) or '-1') end
  local s = tonumber(ARGV[i + 1])
  if s > last[r] then
    last[r] = s
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
    all = 0
  end
end
if all == 0 then return {0, out} end
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('HINCRBY', KEYS[2], 'reports', #out)
return redis.call('XADD', KEYS[3], 'MINID', '~', ARGV[2], '*', 'b', ARGV[1])
