"""A KV transfer's tensors: gathered out of scattered blocks, framed, viewed back and placed into other blocks."""

import torch

from kvferry.common.model.kv_blocks import as_frames, frame_tensor, gather_blocks, scatter_blocks


def test_blocks_round_trip_through_a_raw_frame_into_other_block_ids():
    shape = (3, 10, 4, 2, 2, 5)  # layers, blocks, block size, K/V, kv heads, head dim: the runner's layout
    src = torch.randn(shape)
    source_ids, target_ids = [7, 2, 9], [0, 5, 1]
    kv = gather_blocks(src, source_ids)
    assert kv.shape == (3, 3, 4, 2, 2, 5) and kv.is_contiguous() and torch.equal(kv[:, 1], src[:, 2])
    [frame] = [bytes(f) for f in as_frames(kv)]  # what arrives on the other side
    assert len(frame) == kv.numel() * 4
    dst = torch.zeros(shape)
    scatter_blocks(dst, target_ids, frame_tensor(frame, "float32", list(kv.shape)))
    for s, t in zip(source_ids, target_ids):
        assert torch.equal(dst[:, t], src[:, s])
    untouched = [b for b in range(10) if b not in target_ids]
    assert not dst[:, untouched].any()
    # A group of layers goes alone, and lands in those layers only.
    kv = gather_blocks(src, source_ids, (1, 2))
    assert kv.shape == (1, 3, 4, 2, 2, 5) and torch.equal(kv[0, 0], src[1, 7])
    again = torch.zeros(shape)
    scatter_blocks(again, target_ids, kv, (1, 2))
    assert torch.equal(again[1, 0], src[1, 7]) and not again[0].any() and not again[2].any()


def test_the_transfer_benchmark_measures_both_paths_over_real_sockets():
    from kvferry.tools.bench.transfer import measure

    result = measure(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=3, rounds=2)
    assert result["mib"] == round(2 * 2 * 3 * 4 * 8 * 4 / 2**20, 1)
    assert result["kv_ms"] > 0 and result["raw_ms"] > 0 and result["kv_vs_raw"] > 0


def test_layer_groups_cover_every_layer_once_in_order():
    from kvferry.common.model.kv_blocks import layer_groups

    assert layer_groups(30, 6) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 25), (25, 30)]
    assert layer_groups(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert layer_groups(2, 6) == [(0, 1), (1, 2)] and layer_groups(4, 1) == [(0, 4)]
