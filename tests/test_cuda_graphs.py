"""The decode graphs' batch sizes (bento_pagedllm/cuda_graphs.py): pure functions, no GPU needed."""

from bento_pagedllm.cuda_graphs import batch_size_ladder, faster_graph_sizes


def test_the_ladder_pads_a_batch_by_at_most_7_15_or_31_rows():
    sizes = batch_size_ladder(512)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512 and sizes == sorted(set(sizes))
    for n in range(1, 513):
        pad = next(s for s in sizes if s >= n) - n
        assert pad <= (7 if n <= 64 else 15 if n <= 256 else 31)


def test_a_batch_replays_a_bigger_graph_only_when_it_is_faster_by_the_margin():
    sizes = [64, 128, 256, 448, 512]
    # 448's own graph is slow (a poor GEMM kernel for that row count), 512's replays 20% faster
    replay_ms = [5.0, 7.0, 10.0, 17.0, 13.6]
    assert faster_graph_sizes(sizes, replay_ms) == {64: 64, 128: 128, 256: 256, 448: 512, 512: 512}
    # within the margin, a batch keeps its own graph (timing noise must not move it)
    assert faster_graph_sizes(sizes, [5.0, 7.0, 10.0, 13.8, 13.6], margin=0.03)[448] == 448
    assert faster_graph_sizes(sizes, [5.0, 7.0, 10.0, 11.4, 10.7])[448] == 448  # the default margin
    # the fastest bigger graph, not merely the next one; never a smaller one
    assert faster_graph_sizes([8, 16, 32], [6.0, 5.5, 5.0], margin=0.0) == {8: 32, 16: 32, 32: 32}
    assert faster_graph_sizes([8, 16], [9.0, 5.0], margin=0.5) == {8: 8, 16: 16}
