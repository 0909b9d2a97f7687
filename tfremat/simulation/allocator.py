"""TensorFlow's BFC allocator, replayed: the memory a device's statistics count.

TensorFlow's GPU allocator, and its CPU allocator once `TF_CPU_ALLOCATOR_USE_BFC` is
set (importing tfremat sets it), is a best-fit-with-coalescing allocator
(`tsl/framework/bfc_allocator.cc`). Its rules, which this module follows:

- a request is rounded up to a multiple of 256 bytes;
- it takes the smallest free chunk that fits (the lowest address among equals);
- that chunk is split only when it is at least twice the rounded request (or
  would waste 128 MiB or more); otherwise the request gets it whole;
- a freed chunk merges with its free neighbours in the same region;
- when no free chunk fits, a new region is taken from the system, twice the
  size of the one before (from 2 MiB), doubled again until the request fits
  (`allow_growth`: a CPU's allocator, and a GPU's with memory growth on); a GPU
  without memory growth (TensorFlow's default) takes one region of all the
  memory it may use at its first allocation instead (`region_bytes`).

`get_memory_info(device)["peak"]` counts whole chunks, so a buffer can hold up to
twice its bytes, and how much depends on which chunks are free when it is made:
profiled, the chunks live at the peak held 11-14% more than their buffers asked
for in ResNet50's and MobileNet's plain steps and a U-Net plan's, 29-49% more in
VGG19's plain step (docs/how-it-works.md).
"""

from __future__ import annotations

import bisect
import dataclasses

#: Requests are rounded up to a multiple of this many bytes.
ROUNDING_BYTES = 256
#: Size of the first region the allocator takes from the system.
FIRST_REGION_BYTES = 2 << 20
#: A chunk wasting this much or more on a request is split however small the request.
MAX_INTERNAL_FRAGMENTATION_BYTES = 128 << 20
#: The one region of an allocator without growth, when its device's memory is not
#: known: larger than any step, so every request is carved from it.
WHOLE_DEVICE_BYTES = 1 << 50


def rounded_bytes(nbytes: int) -> int:
    """The bytes a request of `nbytes` asks the allocator for."""
    return max(ROUNDING_BYTES, -(-nbytes // ROUNDING_BYTES) * ROUNDING_BYTES)


@dataclasses.dataclass
class _Chunk:
    size: int
    in_use: bool
    prev: int | None  # address of the neighbouring chunk below, in the same region
    next: int | None  # and above


class BFCAllocator:
    """A replay of TensorFlow's BFC allocator on addresses, without memory.

    Args:
        region_bytes: None: regions grow, each twice the last from 2 MiB
            (TensorFlow's `allow_growth`). Else the size of the one region taken
            at the first allocation (a GPU's allocator without memory growth
            takes all the memory it may use).

    Attributes:
        in_use_bytes: Bytes of the chunks handed out.
        region_bytes: Bytes of all regions taken from the system.

    Example:

    ```python
    bfc = BFCAllocator()
    a = bfc.allocate(9 << 20)  # a 16 MiB region, under twice 9 MiB: handed out whole
    print(bfc.in_use_bytes >> 20)  # 16
    bfc.free(a)
    b = bfc.allocate(5 << 20)  # at least twice 5 MiB: split, 11 MiB stay free
    print(bfc.in_use_bytes >> 20)  # 5
    whole = BFCAllocator(region_bytes=WHOLE_DEVICE_BYTES)
    whole.allocate(9 << 20)  # split from the one region
    print(whole.in_use_bytes >> 20)  # 9
    ```
    """

    def __init__(self, region_bytes: int | None = None) -> None:
        self._chunks: dict[int, _Chunk] = {}
        self._free: list[tuple[int, int]] = []  # (size, address), sorted
        self._next_region = region_bytes or FIRST_REGION_BYTES
        self.region_bytes = 0
        self.in_use_bytes = 0

    @property
    def largest_free_bytes(self) -> int:
        """Bytes of the largest free chunk (0 when none is free)."""
        return self._free[-1][0] if self._free else 0

    def allocate(self, nbytes: int) -> int:
        """Hands out a chunk for `nbytes`; returns its address."""
        need = rounded_bytes(nbytes)
        i = bisect.bisect_left(self._free, (need, -1))
        if i == len(self._free):
            self._extend(need)
            i = bisect.bisect_left(self._free, (need, -1))
        size, address = self._free.pop(i)
        chunk = self._chunks[address]
        if size >= 2 * need or size - need >= MAX_INTERNAL_FRAGMENTATION_BYTES:
            rest = address + need
            self._chunks[rest] = _Chunk(size - need, False, address, chunk.next)
            if chunk.next is not None:
                self._chunks[chunk.next].prev = rest
            chunk.next, chunk.size = rest, need
            bisect.insort(self._free, (size - need, rest))
        chunk.in_use = True
        self.in_use_bytes += chunk.size
        return address

    def free(self, address: int) -> None:
        """Returns the chunk at `address`, merged with its free neighbours."""
        chunk = self._chunks[address]
        chunk.in_use = False
        self.in_use_bytes -= chunk.size
        above = chunk.next
        if above is not None and not self._chunks[above].in_use:
            self._free.remove((self._chunks[above].size, above))
            self._merge(address, above)
        below = chunk.prev
        if below is not None and not self._chunks[below].in_use:
            self._free.remove((self._chunks[below].size, below))
            self._merge(below, address)
            address = below
        bisect.insort(self._free, (self._chunks[address].size, address))

    def _merge(self, address: int, above: int) -> None:
        """Merges the chunk `above` into its neighbour at `address`."""
        upper = self._chunks.pop(above)
        chunk = self._chunks[address]
        chunk.size += upper.size
        chunk.next = upper.next
        if upper.next is not None:
            self._chunks[upper.next].prev = address

    def _extend(self, need: int) -> None:
        """Takes a region large enough for `need` bytes from the system."""
        grew = False
        while need > self._next_region:
            self._next_region *= 2
            grew = True
        address, size = self.region_bytes, self._next_region
        self.region_bytes += size
        self._chunks[address] = _Chunk(size, False, None, None)
        bisect.insort(self._free, (size, address))
        if not grew:
            self._next_region *= 2
