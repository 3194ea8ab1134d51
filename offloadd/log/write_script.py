"""The Lua scripts that write a namespace's keys, and :class:`Ops`, the projection's commands as
the write script's argument list.

``WRITE`` is the only way a record enters the log. It checks first and writes after, so a write
lands entirely or not at all (a MULTI/EXEC whose XADD fails still applies its other commands):
the key types, the owner lease (the fencing token, offloadd.log.owner), the head the writer
expects, the stream's last ID below the first new one, and each record's source position. A
record whose ``(incarnation, seq)`` is not beyond the position the sources hash holds for its
source (the same position again, an earlier seq, an older incarnation) is refused (DECISIONS
52): the log holds that position of the source or a later one. Incarnation 0 (a departure's clear, offloadd.log.ingest) is not
fenced. Positions are msgpack ``[incarnation, seq]`` (offloadd.log.projection); the script
reads each integer as two 32-bit halves, exact where Lua's doubles would round above 2**53.
"""

from __future__ import annotations

from typing import Any

from events.logkeys import LogKeys
from offloadd.log.log_errors import (
    AlreadyLogged,
    ForeignEntry,
    LogConflict,
    OwnershipLost,
)

# KEYS: head, log, sources, owner, then the projection's keys.
# ARGV: expected head ('' = unchecked), owner value ('' = unchecked), number of records n,
#   new head; n x (entry id, record, source, position); ops: command, key index, nargs, args...
# A check that fails returns {code, detail...} having written nothing.
WRITE = """
local kinds = {}
local function kind(i)
  if kinds[i] == nil then kinds[i] = redis.call('TYPE', KEYS[i])['ok'] end
  return kinds[i]
end
local want = {'string', 'stream', 'hash', 'string'}
for i = 1, 4 do
  if kind(i) ~= 'none' and kind(i) ~= want[i] then return {'wrongtype', KEYS[i], kind(i), want[i]} end
end
if ARGV[2] ~= '' then
  local cur = redis.call('GET', KEYS[4])
  if cur ~= ARGV[2] then return {'owner', cur or ''} end
end
if ARGV[1] ~= '' then
  local raw = redis.call('GET', KEYS[1]) or '0'
  if not string.match(raw, '^%d+$') then return {'badhead', raw} end
  if tonumber(raw) ~= tonumber(ARGV[1]) then return {'head', raw} end
end
local n = tonumber(ARGV[3])
if n > 0 and kind(2) == 'stream' then
  local info = redis.call('XINFO', 'STREAM', KEYS[2])
  for j = 1, #info, 2 do
    if info[j] == 'last-generated-id' then
      local ms = tonumber(string.match(info[j + 1], '^(%d+)'))
      if ms >= tonumber(string.match(ARGV[5], '^(%d+)')) then return {'foreign', info[j + 1]} end
    end
  end
end
-- the source fence: a position not beyond the logged one is refused
local function uint(s, i)
  local b = string.byte(s, i)
  if b == nil then return nil end
  if b < 0x80 then return 0, b, i + 1 end
  if b == 0xcf then
    local h1, h2, h3, h4, l1, l2, l3, l4 = string.byte(s, i + 1, i + 8)
    if l4 == nil then return nil end
    return ((h1 * 256 + h2) * 256 + h3) * 256 + h4, ((l1 * 256 + l2) * 256 + l3) * 256 + l4, i + 9
  end
  if b == 0xce then
    local l1, l2, l3, l4 = string.byte(s, i + 1, i + 4)
    if l4 == nil then return nil end
    return 0, ((l1 * 256 + l2) * 256 + l3) * 256 + l4, i + 5
  end
  if b == 0xcd then
    local l1, l2 = string.byte(s, i + 1, i + 2)
    if l2 == nil then return nil end
    return 0, l1 * 256 + l2, i + 3
  end
  if b == 0xcc and #s > i then return 0, string.byte(s, i + 1), i + 2 end
  return nil
end
local function position(s)
  if string.byte(s, 1) ~= 0x92 then return nil end
  local ih, il, i = uint(s, 2)
  if ih == nil then return nil end
  local sh, sl = uint(s, i)
  if sh == nil then return nil end
  return {ih, il, sh, sl}
end
local function not_beyond(new, cur)
  for k = 1, 4 do
    if new[k] ~= cur[k] then return new[k] < cur[k] end
  end
  return true
end
local at = {}
for r = 0, n - 1 do
  local b = 5 + 4 * r
  local src, new = ARGV[b + 2], position(ARGV[b + 3])
  if new == nil then return {'badpos', 'ARGV', src} end
  if new[1] ~= 0 or new[2] ~= 0 then
    local cur = at[src]
    if cur == nil and kind(3) == 'hash' then
      local raw = redis.call('HGET', KEYS[3], src)
      if raw then
        cur = position(raw)
        if cur == nil then return {'badpos', KEYS[3], src} end
      end
    end
    if cur and not_beyond(new, cur) then return {'logged', tostring(r), src} end
    at[src] = new
  end
end
-- end of the source fence
local op_kind = {HSET = 'hash', HDEL = 'hash', SADD = 'set', SREM = 'set'}
local first_op = 5 + 4 * n
local i = first_op
while i <= #ARGV do
  local k, w = tonumber(ARGV[i + 1]), op_kind[ARGV[i]]
  if ARGV[i] == 'DEL' then kinds[k] = 'none'
  elseif kind(k) ~= 'none' and kind(k) ~= w then return {'wrongtype', KEYS[k], kind(k), w}
  elseif ARGV[i] == 'HSET' or ARGV[i] == 'SADD' then kinds[k] = w end
  i = i + 3 + tonumber(ARGV[i + 2])
end
for r = 0, n - 1 do
  local b = 5 + 4 * r
  redis.call('XADD', KEYS[2], ARGV[b], 'r', ARGV[b + 1])
  redis.call('HSET', KEYS[3], ARGV[b + 2], ARGV[b + 3])
end
i = first_op
while i <= #ARGV do
  local nargs = tonumber(ARGV[i + 2])
  redis.call(ARGV[i], KEYS[tonumber(ARGV[i + 1])], unpack(ARGV, i + 3, i + 2 + nargs))
  i = i + 3 + nargs
end
if n > 0 then redis.call('SET', KEYS[1], ARGV[4]) end
return {'ok'}
"""
# KEYS: owner, log. ARGV: owner value ('' = unchecked), min entry id. A log that is not a
# stream is left alone (the next write names it).
TRIM = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'owner'} end
if redis.call('TYPE', KEYS[2])['ok'] ~= 'stream' then return {'none'} end
return {'ok', redis.call('XTRIM', KEYS[2], 'MINID', ARGV[2])}
"""
# KEYS: owner, epoch. ARGV: owner value ('' = unchecked), new epoch, '1' = only if none is set.
# Returns {'owner'} refused, else {'ok', the epoch now}.
SET_EPOCH = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'owner'} end
if ARGV[3] == '1' then redis.call('SET', KEYS[2], ARGV[2], 'NX') else redis.call('SET', KEYS[2], ARGV[2]) end
return {'ok', redis.call('GET', KEYS[2])}
"""
_OP_CHUNK = 512  # members per queued command: Lua's unpack() is bounded (~8000 values)


class Ops:
    """A :class:`~offloadd.log.projection.Pipe` that records projection commands as the write
    script's flat op list. ``keys`` starts with the script's fixed keys (head, log, sources,
    owner); the projection's keys are added as they are named."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self._index = {k: i + 1 for i, k in enumerate(keys)}  # Lua's KEYS count from 1
        self.args: list[Any] = []

    def _key(self, name: str) -> int:
        if name not in self._index:
            self.keys.append(name)
            self._index[name] = len(self.keys)
        return self._index[name]

    def _op(self, cmd: str, name: str, values: list[Any], step: int = 1) -> None:
        size = _OP_CHUNK * step
        for at in range(0, len(values), size):
            part = values[at:at + size]
            self.args.extend((cmd, self._key(name), len(part), *part))

    def hset(self, name: str, key: Any = None, value: Any = None, mapping: Any = None) -> None:
        pairs: list[Any] = [] if key is None else [key, value]
        for f, v in (mapping or {}).items():
            pairs += (f, v)
        self._op("HSET", name, pairs, 2)

    def hdel(self, name: str, *keys: Any) -> None:
        self._op("HDEL", name, list(keys))

    def sadd(self, name: str, *values: Any) -> None:
        self._op("SADD", name, list(values))

    def srem(self, name: str, *values: Any) -> None:
        self._op("SREM", name, list(values))

    def delete(self, *names: str) -> None:
        for name in names:
            self.args.extend(("DEL", self._key(name), 0))


def refusal(code: str, detail: list[str], keys: LogKeys, head: int, hint: str) -> Exception:
    """The error for ``WRITE``'s refusal ``{code, detail...}`` of a write at ``head`` (the
    daemon's), ``hint`` the kvctl commands that repair the namespace. (A head below the
    daemon's is a failover that lost records: offloadd.log.failover, not handled here.)"""
    if code == "head":
        return LogConflict(f"log head moved past {head} under the daemon (it is {detail[0]})")
    if code == "owner":
        now = f"token {detail[0].split(':', 1)[0]}" if detail[0] else "none"
        return OwnershipLost(f"namespace {keys.namespace!r} is no longer owned by this daemon "
                             f"(owner now: {now}); write refused")
    if code == "foreign":
        return ForeignEntry(
            f"log {keys.log} already holds entry ID {detail[0]}, at or past the next offset "
            f"{head + 1}: an entry the daemon did not write; {hint}")
    if code == "badhead":
        return ForeignEntry(f"key {keys.head} holds {detail[0]!r}, not an offset; {hint}")
    if code == "logged":
        return AlreadyLogged(f"the log already holds the position of {detail[1]}", int(detail[0]))
    if code == "badpos":
        return ForeignEntry(f"the position of source {detail[1]!r} in {detail[0]} is not an "
                            f"(incarnation, seq) the daemon wrote; {hint}")
    if code == "wrongtype":
        return ForeignEntry(f"WRONGTYPE: key {detail[0]} is a {detail[1]}, expected a "
                            f"{detail[2]}; {hint}")
    return LogConflict(f"write refused: {code} {detail}")
