"""A KV transfer's tensors: gathered out of scattered blocks, framed, viewed back and placed into other blocks."""
import torch

from kvferry.common.model.kv_blocks import as_frames, frame_tensor, gather_blocks, scatter_blocks


def test_blocks_round_trip_through_raw_frames_into_other_block_ids():
    shape = (3, 10, 4, 2, 5)  # layers, blocks, block size, kv heads, head dim
    k_src, v_src = torch.randn(shape), torch.randn(shape)
    source_ids, target_ids = [7, 2, 9], [0, 5, 1]
    keys, values = gather_blocks(k_src, v_src, source_ids)
    assert keys.shape == (3, 3, 4, 2, 5) and keys.is_contiguous()
    frames = [bytes(f) for f in as_frames(keys, values)]  # what arrives on the other side
    assert len(frames[0]) == keys.numel() * 4
    k_dst, v_dst = torch.zeros(shape), torch.zeros(shape)
    scatter_blocks(k_dst, v_dst, target_ids, frame_tensor(frames[0], "float32", list(keys.shape)),
                   frame_tensor(frames[1], "float32", list(keys.shape)))
    for s, t in zip(source_ids, target_ids):
        assert torch.equal(k_dst[:, t], k_src[:, s]) and torch.equal(v_dst[:, t], v_src[:, s])
    untouched = [b for b in range(10) if b not in target_ids]
    assert not k_dst[:, untouched].any() and not v_dst[:, untouched].any()


def test_the_transfer_benchmark_measures_both_paths_over_real_sockets():
    from kvferry.services.bench.transfer import measure

    result = measure(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=3, rounds=2)
    assert result["mib"] == round(2 * 2 * 3 * 4 * 8 * 4 / 2**20, 1)
    assert result["kv_ms"] > 0 and result["raw_ms"] > 0 and result["kv_vs_raw"] > 0


def test_layer_groups_cover_every_layer_once_in_order():
    from kvferry.common.model.kv_blocks import layer_groups

    assert layer_groups(30, 6) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 25), (25, 30)]
    assert layer_groups(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert layer_groups(2, 6) == [(0, 1), (1, 2)] and layer_groups(4, 1) == [(0, 4)]
