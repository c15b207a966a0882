"""Calibration for int8 on the CPU: each linear layer's input channels whose activations run far above the rest,
found at load time from one forward over Python's own reference documentation (the stdlib's pydoc_data): every
machine calibrates identically, with nothing downloaded. `kvferry bench quantization` uses other topics, held out.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

CALIBRATION_TOPICS = ("assignment", "class", "exceptions", "function", "import", "naming")
CALIBRATION_TOKENS = 512


def calibration_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """CALIBRATION_TOKENS token ids of the calibration text; without a tokenizer (or the stdlib's docs), a fixed
    pseudo-random sequence, which still shows the channels that are large for every token."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = None
    if tokenizer is not None and topics is not None:
        text = "\n\n".join(topics[name] for name in CALIBRATION_TOPICS)
        return list(tokenizer.encode(text))[:CALIBRATION_TOKENS]
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (CALIBRATION_TOKENS,), generator=g).tolist()


class DenseCausalBatch:
    """`attend` for one sequence computed whole, with no cache: enough for a calibration forward."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0].transpose(0, 1)


@contextlib.contextmanager
def record_peaks(model: nn.Module):
    """Yields a dict that each nn.Linear's forwards fill, by module name: the largest |activation| of each of its
    input channels so far."""
    peaks: dict[str, torch.Tensor] = {}

    def recorder(name):
        def hook(module, inputs, output):
            peak = inputs[0].reshape(-1, module.in_features).abs().amax(dim=0).float()
            peaks[name] = peak if name not in peaks else torch.maximum(peaks[name], peak)

        return hook

    handles = [m.register_forward_hook(recorder(name)) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        yield peaks
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def outlier_channels(model: nn.Module, token_ids: list[int], num_channels: int) -> dict[str, torch.Tensor]:
    """Each nn.Linear's (by module name) num_channels input channels of the largest activation over token_ids."""
    with record_peaks(model) as peaks:
        device = model.embed_tokens.weight.device
        ids = torch.tensor(token_ids[: model.rope_cos.shape[0]], device=device)  # no further than the model reaches
        hidden = model(ids, torch.arange(len(ids), device=device), DenseCausalBatch())
        for rows in hidden.split(128):  # the lm_head's input too, a slice at a time: the logits are wide
            model.compute_logits(rows)
    return {name: peak.topk(min(num_channels, peak.numel())).indices for name, peak in peaks.items()}
