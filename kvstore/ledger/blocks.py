"""Paged block ledger: the engine's first ledger (sequence history, docs/rules.md §2).

A sequence owns a *block table*: the list of physical block ids that hold its history, one block
per 128 tokens. A full block can be *committed* under its chained prefix key
(:mod:`kvstore.keys`); from then on another sequence with the same prefix finds it by key and
shares it (refcount > 1) instead of recomputing it.

Free-block policy (exact; the unit and property tests pin it):

- Free blocks live in two queues. The **uncached** queue holds blocks with nothing worth keeping
  (never used, or freed without a registered key); the **cached** queue holds freed blocks that
  still carry a registered key, in least-recently-freed-first order.
- Allocation takes from the uncached queue first (FIFO: at start ids 0, 1, 2, ... in order; a block
  freed without a key goes to its tail). Only when it is empty does allocation evict from the head
  of the cached queue: the least recently freed cached block loses its key and is reused. This is
  vLLM's single free queue with one improvement: a block holding nothing reusable is always taken
  before any cached content is evicted.
- ``free(seq)`` decrements refcounts walking the table *in reverse*, so a sequence's tail block
  enters the cached queue first and is evicted first. Keys are chained, so losing a tail block
  only shortens later hits, while losing a head block would make every later block unreachable.
- A free cached block found by key (``append_cached``/``admit``) leaves the cached queue in O(1)
  (an ``OrderedDict`` keyed by block id), keeping its content.
- One key names at most one block. Committing a block under a key another block already holds
  (two sequences computed the same prefix at once) records the key on the block but leaves the
  first registration in place; when that duplicate is freed it is registered if the key has been
  evicted meanwhile, otherwise it drops the key and goes to the uncached queue.

Every method checks everything before changing anything, so a call that raises leaves the ledger
exactly as it was (no half-acquired blocks). The ledger is a plain, single-threaded object: the
engine's scheduler owns it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence

from kvstore.errors import InvalidArgument, LedgerError, OutOfBlocks
from kvstore.keys import BlockKey, check_key, key_hex


def _check_count(value: object, argument: str, minimum: int) -> int:
    # bool is an int subclass; True blocks is a bug, not a count.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(argument, f"must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgument(argument, f"must be >= {minimum}, got {value}")
    return value


class PagedBlockLedger:
    """Block tables, refcounts and a prefix cache over ``num_blocks`` physical blocks.

    Block ids are ``0 .. num_blocks - 1``. Sequence ids are any hashable value chosen by the caller.
    """

    __slots__ = (
        "_num_blocks",
        "_refcount",
        "_key",
        "_cached",
        "_free_uncached",
        "_free_cached",
        "_tables",
    )

    def __init__(self, num_blocks: int) -> None:
        """Create a ledger with every block free and uncached.

        Raises:
            InvalidArgument: ``num_blocks`` is not an int >= 1.
        """
        self._num_blocks = _check_count(num_blocks, "num_blocks", 1)
        self._refcount = [0] * self._num_blocks
        # Key recorded on each block (None = no content worth keeping).
        self._key: list[BlockKey | None] = [None] * self._num_blocks
        # Registered keys: key -> the one block that serves it.
        self._cached: dict[BlockKey, int] = {}
        self._free_uncached: deque[int] = deque(range(self._num_blocks))
        # Free blocks holding a registered key, least recently freed first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._tables: dict[Hashable, list[int]] = {}

    # --- queries ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Total number of physical blocks."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks with refcount 0 (uncached plus free cached ones), i.e. allocatable now."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached(self) -> int:
        """Keys currently registered (in use or free)."""
        return len(self._cached)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def sequences(self) -> list[Hashable]:
        """Ids of the sequences holding a block table, in creation order."""
        return list(self._tables)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table (physical block ids, logical order).

        Raises:
            LedgerError: unknown sequence.
        """
        return list(self._table(seq_id))

    def refcount(self, block_id: int) -> int:
        """Number of block-table references to ``block_id``.

        Raises:
            InvalidArgument: ``block_id`` is not a block of this ledger.
        """
        self._check_block_id(block_id)
        return self._refcount[block_id]

    def key_of(self, block_id: int) -> BlockKey | None:
        """The key recorded on ``block_id`` (None when it holds no committed content).

        Raises:
            InvalidArgument: ``block_id`` is not a block of this ledger.
        """
        self._check_block_id(block_id)
        return self._key[block_id]

    def is_cached(self, key: BlockKey) -> bool:
        """Whether ``key`` is registered (its block may be in use or free).

        Raises:
            InvalidArgument: ``key`` is not a 32-byte key.
        """
        return check_key(key) in self._cached

    def free_order(self) -> list[int]:
        """The exact order in which allocation would hand out the free blocks right now.

        Uncached free blocks first (FIFO), then free cached blocks, least recently freed first.
        O(num_free); meant for tests, metrics and debugging.
        """
        return [*self._free_uncached, *self._free_cached]

    def get_computed_blocks(self, keys: Iterable[BlockKey]) -> list[int]:
        """Blocks of the longest run of cached keys at the start of ``keys`` (no side effect).

        Stops at the first key that is not registered: keys are chained, so a later hit after a
        miss cannot be used. Applying a cap (docs/rules.md §5: the last 134 tokens are always
        computed) is the caller's job.

        Raises:
            InvalidArgument: a key is not 32 bytes.
        """
        blocks: list[int] = []
        for index, key in enumerate(keys):
            block = self._cached.get(check_key(key, f"keys[{index}]"))
            if block is None:
                break
            blocks.append(block)
        return blocks

    # --- mutations -------------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, n: int) -> list[int]:
        """Append ``n`` fresh blocks to the sequence's table (creating it if new); returns them.

        Blocks come from the uncached free queue first, then by evicting the least recently freed
        cached block (its key is unregistered). Fresh blocks carry no key and have refcount 1.

        Raises:
            InvalidArgument: ``n`` is not an int >= 0.
            OutOfBlocks: fewer than ``n`` free blocks; nothing changed.
        """
        _check_count(n, "n", 0)
        self._check_free(n)
        table = self._tables.setdefault(seq_id, [])
        new = [self._take_free_block() for _ in range(n)]
        table.extend(new)
        return new

    def append_cached(self, seq_id: Hashable, keys: Sequence[BlockKey]) -> list[int]:
        """Append the cached blocks of ``keys`` to the sequence's table (creating it if new).

        Each block's refcount goes up by one; a free one leaves the free queue keeping its
        content. Returns the appended block ids. Use :meth:`get_computed_blocks` first to learn
        how many of a prompt's keys are cached, or :meth:`admit` to do both atomically.

        Raises:
            InvalidArgument: a key is not 32 bytes.
            LedgerError: a key is not cached (names its index); nothing changed.
        """
        blocks = self._lookup_all(keys)
        table = self._tables.setdefault(seq_id, [])
        for block in blocks:
            self._touch(block)
        table.extend(blocks)
        return blocks

    def admit(self, seq_id: Hashable, keys: Sequence[BlockKey], num_blocks: int) -> int:
        """Atomically give a new sequence ``num_blocks`` blocks, reusing its cached prefix.

        ``keys`` are the keys of the prompt's full blocks (at most ``num_blocks``; the trailing
        partial block has none). The longest cached run of them is shared (refcount + 1) and the
        rest of the table is freshly allocated. Returns the number of shared (hit) blocks.

        Free cached blocks that the hit reuses are not counted as allocatable, so the capacity
        check is exact: either the whole table is built or nothing changes.

        Raises:
            InvalidArgument: bad ``num_blocks``, more keys than blocks, or a key not 32 bytes.
            LedgerError: ``seq_id`` already has a block table.
            OutOfBlocks: not enough free blocks for the non-hit part; nothing changed.
        """
        _check_count(num_blocks, "num_blocks", 0)
        if len(keys) > num_blocks:
            raise InvalidArgument(
                "keys", f"{len(keys)} keys for a table of {num_blocks} blocks (at most one each)"
            )
        if seq_id in self._tables:
            raise LedgerError(f"sequence {seq_id!r} already has a block table; free it first")
        hits = self.get_computed_blocks(keys)
        reused_free = len({block for block in hits if self._refcount[block] == 0})
        need = num_blocks - len(hits)
        if need > self.num_free - reused_free:
            raise OutOfBlocks(
                f"sequence {seq_id!r} asked for {need} new blocks ({len(hits)} prefix blocks "
                f"cached) but only {self.num_free - reused_free} are free of {self._num_blocks}"
            )
        table: list[int] = []
        self._tables[seq_id] = table
        for block in hits:
            self._touch(block)
        table.extend(hits)
        table.extend(self._take_free_block() for _ in range(need))
        return len(hits)

    def commit(self, seq_id: Hashable, block_index: int, key: BlockKey) -> None:
        """Mark the full block at ``block_index`` of the sequence as holding ``key``'s content.

        Registers the key so other sequences can share the block. Committing the same key again
        registers it again if it has lost its block since (that block was evicted and reused),
        and changes nothing otherwise. If another block already serves ``key``, the first
        registration stays (see the module docstring for what happens to this duplicate when
        it is freed).

        Raises:
            InvalidArgument: ``key`` is not 32 bytes, or ``block_index`` is not an int.
            LedgerError: unknown sequence, ``block_index`` outside its table, or the block already
                holds a different key.
        """
        key = check_key(key)
        table = self._table(seq_id)
        if not isinstance(block_index, int) or isinstance(block_index, bool):
            raise InvalidArgument(
                "block_index", f"must be an int, got {type(block_index).__name__}"
            )
        if not 0 <= block_index < len(table):
            raise LedgerError(
                f"block_index {block_index} outside sequence {seq_id!r}'s table of "
                f"{len(table)} blocks"
            )
        block = table[block_index]
        held = self._key[block]
        if held == key:
            # The key's registered block may have been evicted since this one was committed.
            self._cached.setdefault(key, block)
            return
        if held is not None:
            raise LedgerError(
                f"block {block} (index {block_index} of sequence {seq_id!r}) already holds key "
                f"{key_hex(held)}, cannot commit it as {key_hex(key)}"
            )
        self._key[block] = key
        self._cached.setdefault(key, block)

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's table: each block's refcount drops by one, tail first.

        Blocks reaching refcount 0 join a free queue: the cached queue's tail if they hold a
        registered key (so the tail block of the sequence is the first of its blocks to be
        evicted), else the uncached queue's tail.

        Raises:
            LedgerError: unknown sequence (never allocated, or already freed).
        """
        table = self._table(seq_id)
        del self._tables[seq_id]
        for block in reversed(table):
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                self._release(block)

    # --- internals -------------------------------------------------------------------------

    def _table(self, seq_id: Hashable) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise LedgerError(
                f"unknown sequence {seq_id!r} (never allocated, or already freed)"
            ) from None

    def _check_block_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or isinstance(block_id, bool):
            raise InvalidArgument("block_id", f"must be an int, got {type(block_id).__name__}")
        if not 0 <= block_id < self._num_blocks:
            raise InvalidArgument(
                "block_id", f"must lie in [0, {self._num_blocks}), got {block_id}"
            )

    def _check_free(self, n: int) -> None:
        if n > self.num_free:
            raise OutOfBlocks(
                f"asked for {n} blocks but only {self.num_free} are free of {self._num_blocks}"
            )

    def _lookup_all(self, keys: Sequence[BlockKey]) -> list[int]:
        blocks: list[int] = []
        for index, key in enumerate(keys):
            block = self._cached.get(check_key(key, f"keys[{index}]"))
            if block is None:
                raise LedgerError(f"keys[{index}] ({key_hex(key)}) is not cached")
            blocks.append(block)
        return blocks

    def _take_free_block(self) -> int:
        # Callers check capacity first, so one of the queues is non-empty.
        if self._free_uncached:
            block = self._free_uncached.popleft()
        else:
            block, _ = self._free_cached.popitem(last=False)
            key = self._key[block]
            assert key is not None and self._cached.get(key) == block
            del self._cached[key]
            self._key[block] = None
        self._refcount[block] = 1
        return block

    def _touch(self, block: int) -> None:
        if self._refcount[block] == 0:
            del self._free_cached[block]
        self._refcount[block] += 1

    def _release(self, block: int) -> None:
        key = self._key[block]
        if key is not None:
            owner = self._cached.setdefault(key, block)
            if owner == block:
                self._free_cached[block] = None
                return
            # A duplicate of content another block still serves: nothing worth keeping.
            self._key[block] = None
        self._free_uncached.append(block)
