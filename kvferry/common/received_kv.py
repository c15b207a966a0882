"""Admitting sequences whose prompt KV was computed elsewhere (a decode worker's side of a transfer): `reserve`
checks a transfer and allocates its blocks when its first layer group comes, `check_layers` checks each group before
the connector places it, and `admit_choices` (`LLMEngine.admit_prefilled`) makes the choices sequences of the engine
once the last group is in.

Functions of an engine, not a part of it: the simulator (tools/sim/received.py) runs them on a stand-in. What they
read of an engine: validate_prompt, validate_params, has_request, constraint_state, vocab_size, block_manager,
scheduler, and, to admit, its index (`_live`), forget and runner.copy_block.
"""

from kvferry.common.block_hash import block_hashes
from kvferry.common.errors import InvalidRequest
from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import Sequence


def reserve(
    engine,
    request_ids: list[str],
    prompt_token_ids: list[int],
    params: list[SamplingParams],
    resume_token_ids: list[int] = (),
    held_blocks: list[int] = (),
) -> list[int] | None:
    """Check a transfer of sequences (one per choice) whose prompt KV was computed elsewhere, and allocate the
    blocks its KV fills: the prompt's blocks after held_blocks (cached blocks holding the first full blocks' KV,
    referenced by the caller for this transfer). None when there is no room now. The caller owns the blocks until
    admit_choices admits the sequences. resume_token_ids: outputs from before a move, whose KV comes with the
    prompt's (one choice only). The first tokens are not needed yet: the sender may still be computing them."""
    if resume_token_ids and len(request_ids) != 1:
        raise InvalidRequest("a resumed request continues exactly one choice")
    if not request_ids or len(request_ids) != len(params):
        raise InvalidRequest("a KV transfer needs one set of parameters per choice")
    tokens = list(prompt_token_ids) + list(resume_token_ids)  # those whose KV comes
    engine.validate_prompt(tokens)
    for request_id, choice_params in zip(request_ids, params):
        engine.validate_params(choice_params)
        if engine.has_request(request_id):
            raise InvalidRequest(f"request id {request_id!r} is already in use")
    num_prompt, bm, scheduler = len(tokens), engine.block_manager, engine.scheduler
    num_held = len(held_blocks)
    if num_held > bm.num_cacheable_blocks(num_prompt):
        raise InvalidRequest(
            f"{num_held} held blocks for {num_prompt} prompt tokens: only full blocks before "
            f"the last token's can be left out"
        )
    if [bm.hash_of.get(b) for b in held_blocks] != block_hashes(tokens[: num_held * bm.block_size], bm.block_size):
        raise InvalidRequest("the held blocks do not hold this prompt's first tokens")
    if not scheduler.could_ever_admit_prefilled(num_prompt + 1, len(request_ids)):
        raise InvalidRequest(
            f"{len(request_ids)} choices of {num_prompt + 1} tokens exceed what this worker can "
            f"run at once (max_num_seqs {scheduler.max_num_seqs}, {bm.num_blocks} blocks)"
        )
    if not scheduler.can_admit_prefilled(num_prompt + 1, len(request_ids), num_held):
        return None
    return bm.allocate(bm.num_blocks_for(num_prompt) - num_held)


def check_layers(layout, blocks: list[int], kv, layer_start: int) -> None:
    """Received K and V ([layers, blocks, block_size, 2, kvh, d]) of layers [layer_start, layer_start +
    kv.shape[0]) must fit a transfer's blocks in this engine's cache layout."""
    num_layers = kv.shape[0] if kv.dim() == 6 else 0
    expected = (num_layers, len(blocks), layout.block_size, 2, layout.num_kv_heads, layout.head_dim)
    if num_layers < 1 or layer_start < 0 or layer_start + num_layers > layout.num_layers or tuple(kv.shape) != expected:
        raise InvalidRequest(
            f"KV of shape {tuple(kv.shape)} from layer {layer_start} into {len(blocks)} "
            f"blocks; this worker has {layout.num_layers} layers of "
            f"{expected[2:]} per block"
        )


def admit_choices(
    engine,
    request_ids: list[str],
    prompt_token_ids: list[int],
    first_token_ids: list[int],
    params: list[SamplingParams],
    blocks: list[int],
    resume_token_ids: list[int] = (),
    held_blocks: list[int] = (),
    grammar=None,
) -> bool:
    """Admit a transfer's sequences once every layer of its blocks is written. The first choice takes over the
    references to held_blocks and blocks; the choices share the prompt's full blocks (ref counts), and each gets its
    own copy of a partly filled last block, since each appends its own tokens there. False when there is no room
    now (the caller still owns the blocks). request_ids may be fewer than reserve's: the choices that ended at their
    first token are left out. grammar: the choices' constraint, compiled."""
    if not request_ids or not len(request_ids) == len(first_token_ids) == len(params):
        raise InvalidRequest("a KV transfer needs one first token and one set of parameters per choice")
    for first_token_id in first_token_ids:
        if not 0 <= first_token_id < engine.vocab_size:
            raise InvalidRequest(f"token id {first_token_id} is outside the vocabulary [0, {engine.vocab_size})")
    num_prompt = len(prompt_token_ids) + len(resume_token_ids)
    bm, scheduler = engine.block_manager, engine.scheduler
    if not scheduler.can_admit_prefilled(num_prompt + 1, len(request_ids), len(held_blocks) + len(blocks)):
        return False
    num_full = num_prompt // bm.block_size
    admitted: list[Sequence] = []
    shared_for_next = False  # references taken for a choice not yet admitted
    try:
        for request_id, first_token_id, choice_params in zip(request_ids, first_token_ids, params):
            seq = Sequence(
                request_id,
                list(prompt_token_ids),
                choice_params,
                output_token_ids=[*resume_token_ids, first_token_id],
                num_computed_tokens=num_prompt,
            )
            seq.constraint_state = engine.constraint_state(choice_params, seq.output_token_ids, grammar)
            if not admitted:
                scheduler.admit_prefilled(seq, [*held_blocks, *blocks])
                admitted.append(seq)
            else:
                first = admitted[0]
                bm.share(first.block_table[:num_full])
                shared_for_next = True
                scheduler.admit_prefilled(seq, first.block_table[:num_full])
                shared_for_next = False
                admitted.append(seq)
                if num_prompt % bm.block_size:
                    engine.runner.copy_block(first.block_table[num_full], seq.block_table[num_full])
            engine._live[request_id] = seq  # the engine's one index (LLMEngine._live)
    except Exception:
        # All or nothing: the caller still owns held_blocks and blocks, and frees them as after a refusal.
        if shared_for_next:
            bm.free(admitted[0].block_table[:num_full])
        for i, seq in reversed(list(enumerate(admitted))):
            scheduler.withdraw_prefilled(seq, len(held_blocks) + len(blocks) if i == 0 else 0)
            engine.forget(seq.request_id)
        raise
    return True
