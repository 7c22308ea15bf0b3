"""Which replica a request goes to: the least loaded live one, unless another live replica
already holds the request's prompt prefix in its cache and is not much busier.

The router keeps, for the chained hashes of prompts' leading full KV blocks (as the
engine's prefix cache keys them: block j's hash covers tokens 0 .. (j+1)*block_size - 1),
the replicas that prefilled them. A request goes to the replicas holding its longest
known prefix, the least loaded of them, while that one has at most ``slack`` more requests
in flight than the least loaded replica overall; otherwise to the least loaded replica,
which then holds the prefix too. So a team's shared system prompt or document is
prefilled once per replica, not once per request, and the load still spreads. The table
is bounded (least recently used hashes are forgotten) and a replica that dies is
forgotten everywhere (its cache died with it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

MAX_PREFIX_BLOCKS = 512
"""Leading blocks hashed per prompt (8k tokens at 16 per block)."""
MAX_ENTRIES = 1 << 17
DEFAULT_SLACK = 8


def block_hashes(prompt_token_ids: list[int], block_size: int, limit: int = MAX_PREFIX_BLOCKS) -> list[int]:
    """The chained hashes of the prompt's leading full blocks (at most ``limit``)."""
    hashes = []
    parent = 0
    for start in range(0, min(len(prompt_token_ids) // block_size, limit) * block_size, block_size):
        parent = hash((parent, tuple(prompt_token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixRouter:
    """The routing table (module docstring). Not thread-safe: the caller holds a lock."""

    def __init__(self, block_size: int, slack: int = DEFAULT_SLACK, max_entries: int = MAX_ENTRIES) -> None:
        self.block_size = block_size
        self.slack = slack
        self.max_entries = max_entries
        self._holders: OrderedDict[int, set[int]] = OrderedDict()

    def choose(self, prompt_token_ids: list[int], loads: Mapping[int, int]) -> tuple[int, list[int]]:
        """The replica for a prompt among ``loads`` (live replica -> requests in flight), and
        the prompt's block hashes (for ``record``). ``loads`` must not be empty."""
        least = min(loads, key=lambda replica: (loads[replica], replica))
        hashes = block_hashes(prompt_token_ids, self.block_size)
        holders: set[int] = set()
        for value in hashes:  # the longest prefix some live replica holds
            found = self._holders.get(value)
            live = found & loads.keys() if found else set()
            if not live:
                break
            holders = live
        if holders:
            best = min(holders, key=lambda replica: (loads[replica], replica))
            if loads[best] <= loads[least] + self.slack:
                return best, hashes
        return least, hashes

    def record(self, hashes: Iterable[int], replica: int) -> None:
        """Note that ``replica`` holds (is about to prefill) these blocks."""
        for value in hashes:
            holders = self._holders.get(value)
            if holders is None:
                holders = self._holders[value] = set()
            holders.add(replica)
            self._holders.move_to_end(value)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def forget(self, replica: int) -> None:
        """Drop ``replica`` from every entry (it died: its prefix cache is gone)."""
        for value in list(self._holders):
            holders = self._holders[value]
            holders.discard(replica)
            if not holders:
                del self._holders[value]
