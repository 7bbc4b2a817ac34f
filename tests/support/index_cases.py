"""Events and the reference answer of the index's contract tests: chains of blocks stored
and removed, in either tier, and a block-by-block walk of what each replica holds."""

from kvmesh.kvcache import BlockRemoved, BlockStored
from kvmesh.kvcache.events import HOST


def stored(chain: list[int], n: int, start: int = 0) -> BlockStored:
    """Blocks start..n of ``chain`` became cached (a run of one chain, as a ledger emits it)."""
    return BlockStored(tuple(chain[start:n]), chain[start - 1] if start else None, 16, chain[0])


def removed(chain: list[int], start: int) -> BlockRemoved:
    """``chain``'s tail from block ``start`` was evicted (tail first, as a ledger evicts)."""
    return BlockRemoved(tuple(chain[start:]), (chain[0],) * (len(chain) - start))


def expected_depths(query: list[int], holdings: dict[str, set[int]]) -> dict[str, int]:
    """The reference: leading blocks of ``query`` each live replica holds consecutively."""
    out = {}
    for rid, held in holdings.items():
        depth = 0
        while depth < len(query) and query[depth] in held:
            depth += 1
        if depth:
            out[rid] = depth
    return out


def host_stored(chain: list[int], n: int, start: int = 0) -> BlockStored:
    """Blocks start..n of ``chain`` landed in the host tier."""
    return BlockStored(tuple(chain[start:n]), chain[start - 1] if start else None, 16, chain[0], HOST)


def host_removed(chain: list[int], start: int, end: int) -> BlockRemoved:
    """Blocks start..end of ``chain`` left the host tier."""
    return BlockRemoved(tuple(chain[start:end]), (chain[0],) * (end - start), HOST)
