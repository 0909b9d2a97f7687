"""The BFC allocator replay against its rules, worked by hand."""

from tfremat.simulation.allocator import (FIRST_REGION_BYTES, WHOLE_DEVICE_BYTES, BFCAllocator,
                                         rounded_bytes)

MB = 2**20


def test_requests_are_rounded_up_to_256_bytes():
    assert [rounded_bytes(n) for n in (0, 1, 256, 257)] == [256, 256, 256, 512]
    bfc = BFCAllocator()
    bfc.allocate(1)
    bfc.allocate(257)
    assert bfc.in_use_bytes == 768


def test_a_chunk_under_twice_the_request_is_handed_out_whole():
    bfc = BFCAllocator()
    a = bfc.allocate(9 * MB)  # regions double from 2 MiB: a 16 MiB one, not split
    assert (bfc.region_bytes, bfc.in_use_bytes) == (16 * MB, 16 * MB)
    bfc.free(a)
    bfc.allocate(5 * MB)  # 16 >= 2 x 5: split, 11 MiB stay free
    assert (bfc.region_bytes, bfc.in_use_bytes) == (16 * MB, 5 * MB)
    bfc.allocate(6 * MB)  # the 11 MiB left are under twice 6 MiB
    assert (bfc.region_bytes, bfc.in_use_bytes) == (16 * MB, 16 * MB)


def test_the_smallest_free_chunk_that_fits_is_taken():
    bfc = BFCAllocator()
    bfc.allocate(64 * MB)
    chunks = [bfc.allocate(n * MB) for n in (8, 1, 4, 1)]
    bfc.free(chunks[0])
    bfc.free(chunks[2])
    in_use = bfc.in_use_bytes
    bfc.allocate(3 * MB)  # the 4 MiB chunk, whole (under 6), not a piece of the 8
    assert bfc.in_use_bytes == in_use + 4 * MB
    bfc.allocate(8 * MB)  # the 8 MiB chunk is still free: no new region
    assert bfc.region_bytes == 128 * MB


def test_freed_neighbours_merge_into_one_chunk():
    bfc = BFCAllocator()
    first = bfc.allocate(FIRST_REGION_BYTES // 2)
    chunks = [bfc.allocate(FIRST_REGION_BYTES // 8) for _ in range(3)]
    bfc.free(chunks[0])
    bfc.free(chunks[2])
    bfc.free(chunks[1])  # merges with both sides and the free rest of the region
    bfc.free(first)
    bfc.allocate(FIRST_REGION_BYTES)  # the whole first region again
    assert bfc.region_bytes == FIRST_REGION_BYTES


def test_chunks_of_different_regions_do_not_merge():
    bfc = BFCAllocator()
    a = bfc.allocate(2 * MB)  # fills the first region (2 MiB)
    b = bfc.allocate(2 * MB)  # a second region, twice as large (4 MiB), split
    bfc.free(a)
    bfc.free(b)
    bfc.allocate(5 * MB)  # no free chunk of 5 MiB: 2 + 4 are not adjacent
    assert bfc.region_bytes == (2 + 4 + 8) * MB


def test_one_region_of_the_whole_device_splits_every_request_from_it():
    """A GPU's allocator without memory growth takes all its memory at once:
    the 9 MiB a growing allocator hands a 16 MiB region for are split from it."""
    bfc = BFCAllocator(region_bytes=WHOLE_DEVICE_BYTES)
    a = bfc.allocate(9 * MB)
    assert (bfc.region_bytes, bfc.in_use_bytes) == (WHOLE_DEVICE_BYTES, 9 * MB)
    b = bfc.allocate(2 * MB)
    bfc.free(a)
    bfc.free(b)
    bfc.allocate(11 * MB)  # a and b merged back into the region: still one
    assert (bfc.region_bytes, bfc.in_use_bytes) == (WHOLE_DEVICE_BYTES, 11 * MB)


def test_in_one_region_a_hole_under_twice_the_request_is_still_handed_out_whole():
    bfc = BFCAllocator(region_bytes=WHOLE_DEVICE_BYTES)
    hole = bfc.allocate(12 * MB)
    bfc.allocate(1 * MB)  # keeps the hole apart from the rest of the region
    bfc.free(hole)
    bfc.allocate(8 * MB)  # the 12 MiB hole fits best, and 12 < 2 x 8
    assert bfc.in_use_bytes == 13 * MB
