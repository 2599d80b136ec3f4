-- The rules of rollout.apply_ack, atomically. KEYS: acks, rollout, meta; ARGV: rank, version,
-- state (0/2 switched, 1 prepared, 3 failed), step, margin, kept, then the deployment's ranks.
-- Returns -1 when the deployment is gone, else {acked, prepared, failed, num_ranks, switch_step,
-- aborted, became_prepared, became_switched, became_failed}.
if redis.call('EXISTS', KEYS[3]) == 0 then return -1 end
local rank, v, state, step = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local function bump(f)
  local last = tonumber(redis.call('HGET', KEYS[1], f) or '0')
  if v > last then redis.call('HSET', KEYS[1], f, v) end
end
local old_switched = tonumber(redis.call('HGET', KEYS[1], rank) or '0')
local aborted = redis.call('HEXISTS', KEYS[2], v .. ':aborted') == 1
local became_failed = 0
if state == '0' or state == '2' then
  bump(rank)
elseif state == '1' then
  bump(rank .. ':p')
  local last = tonumber(redis.call('HGET', KEYS[2], v .. ':step') or '-1')
  if step > last then redis.call('HSET', KEYS[2], v .. ':step', ARGV[4]) end
elseif state == '3' then
  bump(rank .. ':f')
  -- A fixed switch step stands: ranks may already route with v, so a late failure is
  -- counted, not turned into an abort that later pollers would see and others would not.
  if redis.call('HEXISTS', KEYS[2], v .. ':switch') == 0 then
    if not aborted then became_failed = 1 end
    aborted = true
    redis.call('HSET', KEYS[2], v .. ':aborted', 1)
  end
end
local all = redis.call('HGETALL', KEYS[1])
local h = {}
for i = 1, #all, 2 do h[all[i]] = tonumber(all[i + 1]) end
local acked, prepared, failed, n = 0, 0, 0, #ARGV - 6
for i = 7, #ARGV do
  local r = ARGV[i]
  local sw, p, f = h[r] or 0, h[r .. ':p'] or 0, h[r .. ':f'] or 0
  if sw >= v then acked = acked + 1 end
  if sw >= v or p >= v then prepared = prepared + 1 end
  if f == v then failed = failed + 1 end
end
local switch = redis.call('HGET', KEYS[2], v .. ':switch')
local became_prepared = 0
if not switch and not aborted and prepared == n then
  local s = tonumber(redis.call('HGET', KEYS[2], v .. ':step') or '0')
  if s < 0 then s = 0 end
  switch = tostring(s + tonumber(ARGV[5]))
  redis.call('HSET', KEYS[2], v .. ':switch', switch)
  became_prepared = 1
end
local old = v - tonumber(ARGV[6])
if old > 0 then redis.call('HDEL', KEYS[2], old .. ':step', old .. ':switch', old .. ':aborted') end
local became_switched = 0
if (state == '0' or state == '2') and old_switched < v and acked == n then became_switched = 1 end
local out_switch = 0
if switch and not aborted then out_switch = tonumber(switch) end
return {acked, prepared, failed, n, out_switch, aborted and 1 or 0, became_prepared, became_switched, became_failed}
