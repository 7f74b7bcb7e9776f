"""Planted bugs ("mutants") for each assignment task: mistakes a student makes.

tests/test_assignments.py applies every mutant to a copy of the repository, runs the
task's tests on it (`-m chNN_tK`), and fails, naming the mutant, if they all pass: a
task's tests must catch each of its mutants, not just a stub.

A mutant is a textual edit of the task's reference region (`nano_v1.assignments.Mutant`):
`old` must occur exactly once between the task's `# BEGIN TASK` and `# END TASK` lines
and becomes `new`, both written with the file's own indentation. A mutant whose `old`
the region no longer holds fails the integrity check loudly (`mutate_source`), so the
list cannot rot when the reference changes. To add one, append a Mutant to the task's
list below and run `pytest -m assignments tests/test_assignments.py`; if it survives,
strengthen the tests that carry the task's marker until it is caught.
"""

from __future__ import annotations

from nano_v1.assignments import Mutant

MUTANTS: dict[str, list[Mutant]] = {
    "ch01_t1": [
        Mutant(
            "value_from_the_key",
            "writes the token's key into the value cache",
            old="index_copy_(0, slots, value[:num_tokens][has_slot])",
            new="index_copy_(0, slots, key[:num_tokens][has_slot])",
        ),
        Mutant(
            "reads_the_padding_rows",
            "takes the last rows of key/value instead of the first len(slot_mapping)",
            old="index_copy_(0, slots, key[:num_tokens][has_slot])",
            new="index_copy_(0, slots, key[-num_tokens:][has_slot])",
        ),
        Mutant(
            "drops_the_wrong_tokens",
            "drops as many tokens as there are -1 slots, but from the end instead of where they are",
            old="index_copy_(0, slots, key[:num_tokens][has_slot])",
            new="index_copy_(0, slots, key[: len(slots)])",
        ),
        Mutant(
            "keys_only",
            "forgets to write the values",
            old="    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slots, value[:num_tokens][has_slot])\n",
            new="",
        ),
    ],
    "ch01_t2": [
        Mutant(
            "positions_from_zero",
            "places a chunk's queries at positions 0.. instead of after the context already cached",
            old="q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)",
            new="q_pos = torch.arange(0, query_len, device=q.device)",
        ),
        Mutant(
            "positions_one_late",
            "places query i one position too late, so that it also sees the next token's key",
            old="q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)",
            new="q_pos = torch.arange(seq_len - query_len + 1, seq_len + 1, device=q.device)",
        ),
        Mutant(
            "lse_not_written",
            "forgets to store the log-sum-exp of multi-query requests",
            old="        lse[:, start:end] = l.reshape(num_heads, query_len)\n",
            new="",
        ),
        Mutant(
            "heads_misordered",
            "lays the output out as [query, group, KV head] instead of [query, KV head, group]",
            old="o.permute(2, 0, 1, 3)",
            new="o.permute(2, 1, 0, 3)",
        ),
    ],
    "ch02_t1": [
        Mutant(
            "front_keeps_old_back_link",
            "reconnects the head to the new front but not the front back to the head",
            old="        block.prev_free_block = self.fake_free_list_head\n",
            new="",
        ),
        Mutant(
            "popped_blocks_keep_links",
            "leaves the popped blocks' links set, so they still look like members of the queue",
            old="            block.prev_free_block = block.next_free_block = None\n",
            new="",
        ),
        Mutant(
            "count_not_updated",
            "forgets to lower num_free_blocks",
            old="        self.num_free_blocks -= n\n",
            new="",
        ),
        Mutant(
            "pops_one_too_few",
            "off by one: pops n - 1 blocks",
            old="for _ in range(n):",
            new="for _ in range(1, n):",
        ),
    ],
    "ch02_t2": [
        Mutant(
            "floor_division",
            "rounds the block count down: a partly filled last block gets no block",
            old="-(-num_tokens // self.block_size)",
            new="num_tokens // self.block_size",
        ),
        Mutant(
            "ceil_off_by_one",
            "rounds up by adding a whole block: an exactly full last block gets a spare",
            old="-(-num_tokens // self.block_size)",
            new="(num_tokens + self.block_size) // self.block_size",
        ),
        Mutant(
            "forgets_held_blocks",
            "counts the blocks for every slot as new, forgetting those the request already holds",
            old="num_required_blocks - num_held - len(new_computed_blocks)",
            new="num_required_blocks - len(new_computed_blocks)",
        ),
    ],
    "ch02_t3": [
        Mutant(
            "touches_hits_before_checking",
            "takes the cache hits out of the free queue before checking that the rest fits: not all or nothing",
            old="""        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None

        # Committed from here on. Touch the hits first, so that get_new_blocks cannot
        # evict them to make room for this very request.
        if self.enable_caching:
            self.block_pool.touch(new_computed_block_list)
        else:
            assert not any(new_computed_block_list), "cache hits without prefix caching"
""",
            new="""        if self.enable_caching:
            self.block_pool.touch(new_computed_block_list)
        else:
            assert not any(new_computed_block_list), "cache hits without prefix caching"
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None
""",
        ),
        Mutant(
            "hits_not_touched",
            "never touches the cache hits: they keep ref_cnt 0 and stay in the free queue, free to be handed out",
            old="            self.block_pool.touch(new_computed_block_list)\n",
            new="            pass\n",
        ),
        Mutant(
            "hit_tokens_not_counted",
            "counts slots from request.num_computed_tokens, forgetting the tokens the cache hits hold",
            old="num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens",
            new="num_computed_tokens = request.num_computed_tokens",
        ),
        Mutant(
            "no_lookahead_slots",
            "forgets the lookahead slots: draft tokens get no block",
            old="num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens\n",
            new="num_tokens_need_slot = num_computed_tokens + num_new_tokens\n",
        ),
        Mutant(
            "fast_path_ignores_lookahead",
            "the fast path checks that the new tokens fit in the blocks held, not their lookahead slots",
            old="and end + num_lookahead_tokens <= len(req_blocks) * self.block_size",
            new="and end <= len(req_blocks) * self.block_size",
        ),
        Mutant(
            "fast_path_skips_caching",
            "the fast path only checks for room, so a decode step that fills a held block never caches it",
            old="<= self._first_manager.num_cached_block[request_id]",
            new="<= len(req_blocks)",
        ),
        Mutant(
            "caches_lookahead_slots",
            "counts the lookahead slots as final tokens: caches a block whose last slots hold drafts",
            old="num_final_tokens = num_computed_tokens + num_new_tokens\n",
            new="num_final_tokens = num_tokens_need_slot\n",
        ),
        Mutant(
            "caches_scheduled_drafts",
            "caches up to the end of the scheduled tokens, past request.num_tokens: draft tokens count as final",
            old="""            if num_final_tokens > request.num_tokens:
                num_final_tokens = request.num_tokens
""",
            new="",
        ),
        Mutant(
            "allocates_the_whole_sequence",
            "with full_sequence_must_fit, allocates blocks for the whole prompt instead of this chunk's",
            old="coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)",
            new="coordinator.allocate_new_blocks(request_id, num_tokens_to_check)",
        ),
        Mutant(
            "touches_hits_after_allocating",
            "touches the cache hits after allocating the fresh blocks: a hit still in the free queue can be handed out again",
            old="""        if self.enable_caching:
            self.block_pool.touch(new_computed_block_list)
        else:
            assert not any(new_computed_block_list), "cache hits without prefix caching"
        coordinator.save_new_computed_blocks(request_id, new_computed_block_list)
        # Most decode steps fit in the last block: 15 of 16 with block_size 16.
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
""",
            new="""        coordinator.save_new_computed_blocks(request_id, new_computed_block_list)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
        if self.enable_caching:
            self.block_pool.touch(new_computed_block_list)
""",
        ),
        Mutant(
            "counts_group_0_only",
            "checks only the first group's blocks against the free pool: with several groups, too many are allocated",
            old="""coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_to_check, new_computed_block_list
        )""",
            new="""self._first_manager.get_num_blocks_to_allocate(
            request_id, num_tokens_to_check, new_computed_block_list[0]
        )""",
        ),
        Mutant(
            "caches_without_the_hits",
            "counts the final tokens from request.num_computed_tokens, forgetting this step's cache hits",
            old="num_final_tokens = num_computed_tokens + num_new_tokens\n",
            new="num_final_tokens = request.num_computed_tokens + num_new_tokens\n",
        ),
        Mutant(
            "skips_remove_skipped_blocks",
            "never hands back the blocks no query can see (a sliding window's): they stay held",
            old="        coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens)\n",
            new="",
        ),
    ],
    "ch03_t1": [
        Mutant(
            "no_chaining",
            "hashes each block's tokens alone, without its parent's hash",
            old="hash_block_tokens(parent, ",
            new="hash_block_tokens(None, ",
        ),
        Mutant(
            "chain_restarts_each_call",
            "starts every call's chain from nothing instead of the last hash the request has",
            old="parent = request.block_hashes[-1] if request.block_hashes else None",
            new="parent = None",
        ),
        Mutant(
            "hashes_partial_block",
            "also hashes the last, partly filled block",
            old="range(start, num_tokens - block_size + 1, block_size)",
            new="range(start, num_tokens, block_size)",
        ),
        Mutant(
            "misses_block_just_filled",
            "off by one: a block that has just become full waits a token for its hash",
            old="num_tokens - block_size + 1",
            new="num_tokens - block_size",
        ),
        Mutant(
            "rehashes_from_the_start",
            "hashes every full block again on each call instead of the new ones only",
            old="start = len(request.block_hashes) * block_size",
            new="start = 0",
        ),
    ],
    "ch03_t2": [
        Mutant(
            "no_length_cap",
            "walks every hash, past max_length: a fully cached prompt hits its last token's block too",
            old="itertools.islice(block_hashes, max_num_blocks)",
            new="block_hashes",
        ),
        Mutant(
            "cap_one_block_short",
            "stops one block before max_length allows",
            old="itertools.islice(block_hashes, max_num_blocks)",
            new="itertools.islice(block_hashes, max_num_blocks - 1)",
        ),
        Mutant(
            "skips_misses",
            "steps over a miss and keeps matching the blocks after it",
            old="                break\n",
            new="                continue\n",
        ),
        Mutant(
            "starts_at_block_one",
            "skips the prompt's first block",
            old="itertools.islice(block_hashes, max_num_blocks)",
            new="itertools.islice(block_hashes, 1, max_num_blocks)",
        ),
    ],
    "ch04_t1": [
        Mutant(
            "eos_despite_ignore_eos",
            "stops at EOS even when the request asked to ignore it",
            old="if not params.ignore_eos and last_token_id == request.eos_token_id:",
            new="if last_token_id == request.eos_token_id:",
        ),
        Mutant(
            "max_tokens_off_by_one",
            "uses > for >= on max_tokens: one token too many",
            old="request.num_output_tokens >= request.max_tokens",
            new="request.num_output_tokens > request.max_tokens",
        ),
        Mutant(
            "max_model_len_off_by_one",
            "uses > for >= on max_model_len: a token past the context window",
            old="request.num_tokens >= max_model_len",
            new="request.num_tokens > max_model_len",
        ),
        Mutant(
            "stop_token_before_length",
            "checks EOS before the length caps, so a capped request reports a stop",
            old="    if request.num_tokens >= max_model_len or (",
            new=(
                "    if request.output_token_ids[-1] == request.eos_token_id and not request.sampling_params.ignore_eos:\n"
                "        request.status = RequestStatus.FINISHED_STOPPED\n"
                "        return True\n"
                "    if request.num_tokens >= max_model_len or ("
            ),
        ),
        Mutant(
            "no_stop_reason",
            "stops at a stop token id without recording which one",
            old="        request.stop_reason = last_token_id\n",
            new="",
        ),
    ],
    "ch04_t2": [
        Mutant(
            "forgets_drafts",
            "counts the known tokens only: the drafts to verify are never scheduled",
            old="request.num_tokens_with_spec - num_computed_tokens",
            new="request.num_tokens - num_computed_tokens",
        ),
        Mutant(
            "ignores_cache_hits",
            "counts from request.num_computed_tokens, not the num_computed_tokens given (which includes cache hits)",
            old="request.num_tokens_with_spec - num_computed_tokens",
            new="request.num_tokens_with_spec - request.num_computed_tokens",
        ),
        Mutant(
            "zero_threshold_caps",
            "treats a long_prefill_token_threshold of 0 (no threshold) as a cap of 0 tokens",
            old="if 0 < self.long_prefill_token_threshold < num_new_tokens:",
            new="if self.long_prefill_token_threshold < num_new_tokens:",
        ),
        Mutant(
            "no_threshold",
            "ignores long_prefill_token_threshold",
            old="            num_new_tokens = self.long_prefill_token_threshold\n",
            new="            pass\n",
        ),
        Mutant(
            "context_cap_off_by_one",
            "caps at max_model_len - num_computed_tokens: the token sampled next falls outside the context",
            old="self.max_model_len - 1 - num_computed_tokens",
            new="self.max_model_len - num_computed_tokens",
        ),
    ],
    "ch05_t1": [
        Mutant(
            "wrong_row_stride",
            "steps between block-table rows by block_size instead of the row length",
            old="req_indices * self.max_num_blocks_per_req",
            new="req_indices * self.block_size",
        ),
        Mutant(
            "position_as_block_index",
            "indexes the block table by position instead of position // block_size",
            old="positions // self.block_size",
            new="positions",
        ),
        Mutant(
            "block_id_not_scaled",
            "adds the offset to the block id itself instead of to the block's first slot",
            old="block_numbers * self.block_size,",
            new="block_numbers,",
        ),
        Mutant(
            "position_as_offset",
            "adds the whole position instead of the offset within the block",
            old="positions % self.block_size,",
            new="positions,",
        ),
    ],
    "ch05_t2": [
        Mutant(
            "positions_forget_computed",
            "numbers each request's tokens from 0 instead of from its computed tokens",
            old="np.add(input_batch.num_computed_tokens_cpu[req_indices], chunk_offsets, out=positions_np)",
            new="positions_np[:] = chunk_offsets",
        ),
        Mutant(
            "positions_not_a_view",
            "computes the positions into a new array, so self.positions is never filled",
            old="positions_np = self.positions.np[:total_num_tokens]",
            new="positions_np = np.empty(total_num_tokens, dtype=self.positions.np.dtype)",
        ),
        Mutant(
            "offsets_from_chunk_ends",
            "measures each token's offset from its chunk's end instead of its start",
            old="cu_num_tokens - num_scheduled_tokens, num_scheduled_tokens",
            new="cu_num_tokens, num_scheduled_tokens",
        ),
        Mutant(
            "exclusive_cumsum",
            "makes cu_num_tokens the chunks' starts instead of their ends",
            old="cu_num_tokens = np.cumsum(num_scheduled_tokens)",
            new="cu_num_tokens = np.cumsum(num_scheduled_tokens) - num_scheduled_tokens",
        ),
        Mutant(
            "starts_at_num_tokens",
            "numbers each request's tokens from its known tokens (num_tokens) instead of its computed ones",
            old="input_batch.num_computed_tokens_cpu[req_indices]",
            new="input_batch.num_tokens[req_indices]",
        ),
    ],
    "ch06_t1": [
        Mutant(
            "values_into_both_caches",
            "stores the token's key into the value cache too",
            old="tl.store(value_cache_ptr + cache_offs, value, mask=mask)",
            new="tl.store(value_cache_ptr + cache_offs, key, mask=mask)",
        ),
        Mutant(
            "first_head_only",
            "copies the first KV head of each token and drops the others",
            old="mask = (offs_h < NUM_KV_HEADS)[:, None]",
            new="mask = (offs_h < 1)[:, None]",
        ),
        Mutant(
            "wrong_token_row",
            "steps between tokens by the head stride: reads another token's row",
            old="key_ptr + token * stride_key_tok",
            new="key_ptr + token * stride_key_head",
        ),
        Mutant(
            "block_start_only",
            "writes every token at the start of its block, forgetting its offset in the block",
            old="in_block = slot % BLOCK_SIZE",
            new="in_block = slot * 0",
        ),
    ],
    "ch06_t2": [
        Mutant(
            "output_not_rescaled",
            "adds a tile's P @ V without rescaling the output accumulated under the old max",
            old="acc = acc * alpha[:, None] + tl.dot(",
            new="acc = acc + tl.dot(",
        ),
        Mutant(
            "sum_not_rescaled",
            "adds a tile's probabilities without rescaling the running sum under the old max",
            old="L = L * alpha + tl.sum(P, axis=1)",
            new="L = L + tl.sum(P, axis=1)",
        ),
        Mutant(
            "max_never_updated",
            "forgets to keep the new running max for the next tile",
            old="        M = M_new\n",
            new="",
        ),
        Mutant(
            "exp_under_the_old_max",
            "exponentiates the tile's scores against the old max, before this tile raised it",
            old="P = tl.exp(S - M_safe[:, None])",
            new='P = tl.exp(S - tl.where(M > float("-inf"), M, 0.0)[:, None])',
        ),
    ],
    "ch07_t1": [
        Mutant(
            "plus_inf_is_not_empty",
            "takes an empty prefix's LSE of +inf at face value, as if it held all the mass",
            old='    p_lse[p_lse == float("inf")] = float("-inf")\n',
            new="",
        ),
        Mutant(
            "no_shift_by_the_max",
            "weights by exp(lse) directly: exp(1000) overflows float32",
            old="max_lse = torch.maximum(p_lse, s_lse)",
            new="max_lse = torch.zeros_like(p_lse)",
        ),
        Mutant(
            "both_empty_is_nan",
            "shifts by a max LSE of -inf when both parts are empty: exp(-inf - -inf) is NaN",
            old='    max_lse[max_lse == float("-inf")] = 0.0  # both empty: any finite shift will do\n',
            new="",
        ),
        Mutant(
            "weights_not_normalised",
            "adds the parts weighted by exp(lse - max) without dividing by the weights' sum",
            old="p_scale = (p_weight / safe_total)",
            new="p_scale = (p_weight / 1.0)",
        ),
        Mutant(
            "lse_not_shifted_back",
            "returns log(total) as the merged LSE, forgetting to add the max it was shifted by",
            old="output_lse.copy_(torch.log(total) + max_lse)",
            new="output_lse.copy_(torch.log(total))",
        ),
    ],
    "ch07_t2": [
        Mutant(
            "prefix_threshold_off_by_one",
            "refuses a prefix of exactly 256 tokens",
            old="if common_prefix_len < 256:",
            new="if common_prefix_len <= 256:",
        ),
        Mutant(
            "cascades_with_alibi",
            "cascades with ALiBi, whose bias the unmasked prefix pass does not apply",
            old="if use_alibi or use_sliding_window or use_local_attention:",
            new="if use_sliding_window or use_local_attention:",
        ),
        Mutant(
            "request_threshold_off_by_one",
            "cascades with 7 requests; vLLM needs at least 8",
            old="if num_reqs < 8:",
            new="if num_reqs < 7:",
        ),
        Mutant(
            "flash_decoding_without_gqa",
            "takes multi-head attention (one query head per KV head) as flash-decoding",
            old="num_queries_per_kv > 1 and bool(np.all(query_lens == 1))",
            new="bool(np.all(query_lens == 1))",
        ),
        Mutant(
            "cascade_per_kv_head",
            "gives cascade one program per KV head instead of per query head",
            old="cascade_ctas = num_query_heads *",
            new="cascade_ctas = num_kv_heads *",
        ),
        Mutant(
            "cascade_in_one_wave",
            "forgets that cascade's programs run in waves over the SMs",
            old="cascade_time = cascade_waves * num_prefix_tiles",
            new="cascade_time = num_prefix_tiles",
        ),
    ],
    "ch07_t3": [
        Mutant(
            "causal_prefix_pass",
            "masks the prefix pass causally, as if the batch's queries were one request's last tokens",
            old="        causal=False,\n",
            new="        causal=True,\n",
        ),
        Mutant(
            "suffix_pass_not_causal",
            "runs the suffix pass without a mask: a chunk's queries see the keys after them",
            old="        causal=True,\n",
            new="        causal=False,\n",
        ),
        Mutant(
            "suffix_from_block_zero",
            "gives the suffix pass the whole block table, so it reads the prefix blocks as the suffix",
            old="block_table=block_table[:, num_common_kv_blocks:],",
            new="block_table=block_table,",
        ),
        Mutant(
            "suffix_counts_the_prefix",
            "gives the suffix pass each request's whole context length, counting the prefix twice",
            old="seqused_k=suffix_kv_lens,",
            new="seqused_k=suffix_kv_lens + common_prefix_len,",
        ),
        Mutant(
            "prefix_pass_of_the_first_request",
            "runs the prefix pass over the first request's queries only",
            old="cu_seqlens_q=cu_prefix_query_lens,",
            new="cu_seqlens_q=cu_query_lens[:2],",
        ),
        Mutant(
            "outputs_with_the_other_lse",
            "merges each pass's output with the other pass's log-sum-exp",
            old="ops.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse)",
            new="ops.merge_attn_states(output, prefix_output, suffix_lse, suffix_output, prefix_lse)",
        ),
        Mutant(
            "suffix_pass_only",
            "copies the suffix pass to the output without the merge: the shared prefix is left out",
            old="ops.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse)",
            new="output.copy_(suffix_output)",
        ),
        Mutant(
            "returns_before_the_merge",
            "returns the suffix pass's output and never writes `output`, which the caller reads",
            old="    ops.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse)\n"
            "    return output\n",
            new="    return suffix_output\n",
        ),
        Mutant(
            "prefix_max_seqlen_q_of_one_request",
            "gives the prefix pass the longest request's query count as max_seqlen_q, not the whole batch's",
            old="max_seqlen_q=num_tokens,",
            new="max_seqlen_q=max_query_len,",
        ),
        Mutant(
            "prefix_max_seqlen_k_of_the_context",
            "gives the prefix pass the longest whole context as max_seqlen_k, though it reads the prefix only",
            old="max_seqlen_k=common_prefix_len,",
            new="max_seqlen_k=max_kv_len,",
        ),
        Mutant(
            "suffix_max_seqlen_k_counts_the_prefix",
            "gives the suffix pass the longest whole context as max_seqlen_k, counting the prefix it skips",
            old="max_seqlen_k=max_kv_len - common_prefix_len,",
            new="max_seqlen_k=max_kv_len,",
        ),
    ],
    "ch08_t1": [
        Mutant(
            "op_joins_the_piece_before",
            "gives a splitting op the id of the dense piece before it",
            old="""            subgraph_id += 1
            node_to_subgraph_id[node] = subgraph_id
""",
            new="""            node_to_subgraph_id[node] = subgraph_id
""",
        ),
        Mutant(
            "piece_after_joins_the_op",
            "lets the ops after a splitting op join its piece",
            old="""            splitting_ids.add(subgraph_id)
            subgraph_id += 1
""",
            new="""            splitting_ids.add(subgraph_id)
""",
        ),
        Mutant(
            "ops_not_marked",
            "forgets to record which pieces are splitting ops",
            old="            splitting_ids.add(subgraph_id)\n",
            new="",
        ),
        Mutant(
            "every_call_splits",
            "treats every function call as a splitting op",
            old='node.op == "call_function" and op_name(node.target) in splitting',
            new='node.op == "call_function"',
        ),
    ],
    "ch08_t2": [
        Mutant(
            "ignores_the_runtime_mode",
            "captures in any graph mode, not only the wrapper's own",
            old="if forward_context.cudagraph_runtime_mode != self.runtime_mode or descriptor is None:",
            new="if descriptor is None:",
        ),
        Mutant(
            "captures_every_call",
            "captures a new graph on every call instead of replaying the one it has",
            old="entry = self.entries.get(descriptor)",
            new="entry = None",
        ),
        Mutant(
            "no_address_check",
            "replays even when the inputs moved since the capture",
            old="assert tensor_addresses(args) == entry.input_addresses, (",
            new="assert True or tensor_addresses(args) == entry.input_addresses, (",
        ),
        Mutant(
            "replay_returns_fresh_tensors",
            "returns a new eager result after the replay instead of the graph's outputs",
            old="        return entry.output\n",
            new="        return self.runnable(*args)\n",
        ),
        Mutant(
            "capture_not_counted",
            "forgets to count the capture",
            old="            compilation_counter.num_cudagraph_captured += 1\n",
            new="",
        ),
    ],
    "ch09_t1": [
        Mutant(
            "idle_core_spins",
            "returns at once when idle, so the busy loop spins on an empty scheduler",
            old="        while not self.scheduler.has_unfinished_requests() and not self.batch_queue:\n",
            new="        while False:\n",
        ),
        Mutant(
            "busy_core_ignores_new_requests",
            "takes no queued message while busy: new requests wait until every running one is done",
            old="""        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())
""",
            new="",
        ),
        Mutant(
            "one_message_per_step",
            "takes one queued message per step instead of all of them",
            old="while not self.input_queue.empty():",
            new="if not self.input_queue.empty():",
        ),
        Mutant(
            "busy_core_waits",
            "waits for one more message even when busy",
            old="        while not self.input_queue.empty():\n",
            new="        self._handle_client_request(*self.input_queue.get())\n        while not self.input_queue.empty():\n",
        ),
    ],
    "ch09_t2": [
        Mutant(
            "abort_adds",
            "treats an ABORT as an ADD",
            old="            self.abort_requests(request)\n",
            new="            self.add_request(request)\n",
        ),
        Mutant(
            "failure_kills_the_core",
            "lets a failed call's exception escape: the engine core dies",
            old="            except Exception as e:",
            new="            except KeyError as e:",
        ),
        Mutant(
            "failure_not_reported",
            "answers a failed call without saying it failed",
            old='                output.failure_message = f"call to {method_name} failed: {e!r}"\n',
            new="                pass\n",
        ),
        Mutant(
            "answer_lost",
            "never sends the answer of a utility call",
            old="            self.output_queue.put_nowait(EngineCoreOutputs(utility_output=output))\n",
            new="",
        ),
        Mutant(
            "wrong_call_id",
            "answers under call id 0, so the client cannot match the answer to its call",
            old="output = UtilityOutput(call_id)",
            new="output = UtilityOutput(0)",
        ),
    ],
    "ch09_t3": [
        Mutant(
            "stop_not_aborted",
            "never asks the core to abort a request a stop string ended: the core generates on to max_tokens",
            old="""                    if not out.finished:
                        reqs_to_abort.append(out.request_id)  # the core still runs it
""",
            new="",
        ),
        Mutant(
            "aborts_what_the_core_finished",
            "asks the core to abort a stop-string request even when the core finished it in the same step",
            old="""                    if not out.finished:
                        reqs_to_abort.append(out.request_id)  # the core still runs it
""",
            new="""                    reqs_to_abort.append(out.request_id)
""",
        ),
        Mutant(
            "stop_str_inclusion_inverted",
            "keeps the stop string in the text without include_stop_str_in_output, and drops it with it",
            old="text[: idx + len(stop_str)] if state.include_stop_str_in_output else text[:idx]",
            new="text[:idx] if state.include_stop_str_in_output else text[: idx + len(stop_str)]",
        ),
        Mutant(
            "new_tokens_for_new_characters",
            "searches back from the end by the number of new tokens, not new characters: misses a stop "
            "string that ends inside a step's new text",
            old="find_stop_string(text, len(delta), state.stop)",
            new="find_stop_string(text, len(out.new_token_ids), state.stop)",
        ),
        Mutant(
            "searches_only_the_new_text",
            "looks for stop strings in this step's new text alone: misses one that began in an earlier step, "
            "and cuts the text at an index into the new text",
            old="find_stop_string(text, len(delta), state.stop)",
            new="find_stop_string(delta, len(delta), state.stop)",
        ),
        Mutant(
            "no_hold_back",
            "shows a running request's whole text: the start of a stop string is streamed, and cannot be "
            "taken back when the stop string completes",
            old="            text = state.visible_text(text, finished=finish_reason is not None)\n",
            new="",
        ),
        Mutant(
            "holds_back_after_a_stop",
            "treats a request a stop string ended as still running (only the core's finish counts), so "
            "its final text loses the held-back tail",
            old="state.visible_text(text, finished=finish_reason is not None)",
            new="state.visible_text(text, finished=out.finished)",
        ),
        Mutant(
            "finished_state_kept",
            "never frees a finished request's state: the processor leaks it and counts it as unfinished",
            old="                del self.request_states[out.request_id]\n",
            new="",
        ),
        Mutant(
            "parent_freed_with_first_child",
            "frees the parent when its first child finishes, while the others still run",
            old="""                if parent.finished():
                    del self.parent_requests[parent.request_id]
""",
            new="""                del self.parent_requests[parent.request_id]
""",
        ),
        Mutant(
            "final_only_streams",
            "sends FINAL_ONLY requests an output every step instead of one when all n completions finish",
            old="if parent.output_kind != RequestOutputKind.FINAL_ONLY or parent.finished():",
            new="if True:",
        ),
        Mutant(
            "stats_not_counted",
            "never counts the outputs in iteration_stats: no tokens, TTFTs or inter-token latencies",
            old="""            if iteration_stats is not None:
                iteration_stats.update_from_output(
                    len(out.new_token_ids), len(parent.prompt_token_ids), state.stats
                )
""",
            new="",
        ),
        Mutant(
            "late_output_crashes",
            "looks up each output's state with [] : an output of a request already finished or aborted "
            "here (the core had not seen the abort yet) raises KeyError",
            old="state = self.request_states.get(out.request_id)",
            new="state = self.request_states[out.request_id]",
        ),
    ],
    "ch10_t1": [
        Mutant(
            "no_preference_for_k_known_tokens",
            "takes the latest occurrence even when an earlier one is followed by k known tokens",
            old="            latest_end = np.where(latest_full_end != NO_MATCH, latest_full_end, latest_end)\n",
            new="",
        ),
        Mutant(
            "shortest_n_wins",
            "keeps the first (shortest) n-gram that matched instead of the longest",
            old="best_end = np.where(latest_end != NO_MATCH, latest_end, best_end)",
            new="best_end = np.where(best_end == NO_MATCH, latest_end, best_end)",
        ),
        Mutant(
            "matches_itself",
            "lets the row's own suffix count as an earlier occurrence, with no token after it",
            old="match = np.arange(width)[None, :] <= last - 2",
            new="match = np.arange(width)[None, :] <= last - 1",
        ),
        Mutant(
            "drafts_past_the_known_tokens",
            "always drafts k tokens, reading past the row's known tokens",
            old="np.minimum(k, last[:, 0] - start)",
            new="k",
        ),
        Mutant(
            "ignores_min_n",
            "accepts n-grams shorter than min_n",
            old="if n >= min_n:",
            new="if n >= 1:",
        ),
    ],
    "ch10_t2": [
        Mutant(
            "accepts_always",
            "keeps every draft",
            old="accepted = uniform < draft_probs",
            new="accepted = uniform <= 1.0",
        ),
        Mutant(
            "redraws_from_the_target",
            "on rejection draws from p itself, which may give the rejected draft back",
            old="residual = probs.scatter(1, draft_token_ids.unsqueeze(1), 0.0)",
            new="residual = probs",
        ),
        Mutant(
            "accepts_too_often",
            "keeps a draft with probability sqrt(p(draft)) instead of p(draft)",
            old="accepted = uniform < draft_probs",
            new="accepted = uniform < draft_probs.sqrt()",
        ),
        Mutant(
            "probability_of_the_argmax",
            "keeps a draft with the probability of the most likely token instead of the draft's own",
            old="draft_probs = probs.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)",
            new="draft_probs = probs.max(dim=1).values",
        ),
        Mutant(
            "redraws_ignore_seeds",
            "redraws a seeded request's token from the global generator",
            old="random_sample(residual, token_generators)",
            new="random_sample(residual, {})",
        ),
    ],
    "ch11_t1": [
        Mutant(
            "ignores_the_compute_budget",
            "encodes every image the chunk covers, however little of the step's encoder budget is left",
            old="request, i, encoder_compute_budget, num_tokens_to_schedule",
            new="request, i, 10**9, num_tokens_to_schedule",
        ),
        Mutant(
            "never_cuts_the_chunk",
            "skips an image it cannot encode now but lets the chunk run over its positions",
            old="                num_new_tokens = max(start_pos - num_computed_tokens, 0)\n",
            new="",
        ),
        Mutant(
            "encodes_a_repeat_twice",
            "encodes an image again when the same one appears earlier in the prompt",
            old="            if mm_feature.identifier in mm_hashes_to_schedule:\n"
            "                continue  # the same image earlier in this prompt: encoded once\n",
            new="",
        ),
        Mutant(
            "reencodes_computed_images",
            "encodes images whose positions are already in the KV cache, behind the chunk",
            old="            if start_pos + num_encoder_tokens <= num_computed_tokens:\n"
            "                continue  # its positions are in the KV cache already\n",
            new="",
        ),
        Mutant(
            "splits_images_when_told_not_to",
            "ignores disable_chunked_mm_input: a chunk may end inside an image",
            old="                self.disable_chunked_mm_input\n",
            new="                False\n",
        ),
    ],
    "ch11_t2": [
        Mutant(
            "only_at_the_block_start",
            "looks for images at the block's first position only",
            old="if offset >= end_token_idx:",
            new="if offset >= start_token_idx + 1:",
        ),
        Mutant(
            "one_short_at_the_block_end",
            "misses an image that starts at the block's last position",
            old="if offset >= end_token_idx:",
            new="if offset >= end_token_idx - 1:",
        ),
        Mutant(
            "keeps_the_image_just_before",
            "off by one: also keys an image that ends right where the block starts",
            old="> start_token_idx:",
            new=">= start_token_idx:",
        ),
        Mutant(
            "no_stop_at_the_block_end",
            "keys the block with every image from it to the prompt's end",
            old="        if offset >= end_token_idx:\n            break\n",
            new="",
        ),
    ],
    "ch12_t1": [
        Mutant(
            "frees_one_block_too_many",
            "also drops the block that holds the window's oldest key",
            old="first_useful_block = first_useful_token // self.block_size",
            new="first_useful_block = first_useful_token // self.block_size + 1",
        ),
        Mutant(
            "window_off_by_one",
            "takes the key at num_computed_tokens - w + 1 for outside the window",
            old="first_useful_token = num_computed_tokens - self.sliding_window + 1",
            new="first_useful_token = num_computed_tokens - self.sliding_window + 2",
        ),
        Mutant(
            "nulls_without_freeing",
            "replaces the blocks by the null block but never gives them back to the pool",
            old="self.block_pool.free_blocks(removed_blocks)",
            new="self.block_pool.free_blocks([])",
        ),
        Mutant(
            "frees_without_nulling",
            "gives the blocks back but leaves them in the request's table",
            old="            blocks[i] = self._null_block\n",
            new="",
        ),
    ],
    "ch12_t2": [
        Mutant(
            "search_from_the_left",
            "scans from block 0 instead of from the right",
            old="for i in range(max_num_blocks - 1, -1, -1):",
            new="for i in range(max_num_blocks):",
        ),
        Mutant(
            "one_block_too_many_needed",
            "wants one block more than the window's keys fill before it accepts a run",
            old="if num_contiguous_blocks >= sliding_window_contiguous_blocks:",
            new="if num_contiguous_blocks > sliding_window_contiguous_blocks:",
        ),
        Mutant(
            "keeps_blocks_after_the_run",
            "ends the hit at max_length instead of right after the run",
            old="                    del computed[i + num_contiguous_blocks :]\n",
            new="                    pass\n",
        ),
        Mutant(
            "drops_a_short_run_at_the_start",
            "refuses a run that reaches block 0 when it is shorter than the window",
            old="                del computed[num_contiguous_blocks:]\n",
            new="                del computed[:]\n",
        ),
        Mutant(
            "run_survives_a_miss",
            "does not restart the run at a miss",
            old="                num_contiguous_blocks = 0\n",
            new="",
        ),
    ],
    "ch13_t1": [
        Mutant(
            "kv_heads_by_rank",
            "gives rank r the r-th KV head even when several ranks must share one",
            old="self.tp_rank if shard_id == \"q\" else self.tp_rank // self.num_kv_head_replicas",
            new="self.tp_rank",
        ),
        Mutant(
            "first_shard_on_every_rank",
            "copies rank 0's heads on every rank",
            old="loaded_weight.narrow(0, shard_rank * size, size)",
            new="loaded_weight.narrow(0, 0, size)",
        ),
        Mutant(
            "every_shard_at_offset_zero",
            "writes q, k and v all at the start of the fused parameter",
            old="param.data.narrow(0, offset, size)",
            new="param.data.narrow(0, 0, size)",
        ),
    ],
    "ch13_t2": [
        Mutant(
            "no_all_reduce",
            "returns this rank's partial product without summing over the ranks",
            old="return tensor_model_parallel_all_reduce(output_parallel)",
            new="return output_parallel",
        ),
        Mutant(
            "reduces_twice",
            "sums over the ranks twice",
            old="return tensor_model_parallel_all_reduce(output_parallel)",
            new="return tensor_model_parallel_all_reduce(tensor_model_parallel_all_reduce(output_parallel))",
        ),
        Mutant(
            "scales_by_the_ranks",
            "multiplies each rank's partial product by the number of ranks, as if it were an average",
            old="output_parallel = F.linear(x, self.weight, bias)",
            new="output_parallel = F.linear(x, self.weight, bias) * get_tensor_model_parallel_world_size()",
        ),
    ],
    "ch14_t1": [
        Mutant(
            "every_step_samples",
            "adds a placeholder for every scheduled request, prefill chunks short of the prompt's end included",
            old=(
                "            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:\n"
                "                request.num_output_placeholders += 1\n"
            ),
            new="            request.num_output_placeholders += 1\n",
        ),
        Mutant(
            "forgets_the_tokens_on_their_way",
            "compares with num_tokens alone, so a step scheduled while another is in flight samples nothing",
            old="if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:",
            new="if request.num_computed_tokens == request.num_tokens:",
        ),
        Mutant(
            "one_placeholder_at_most",
            "sets the count to 1 instead of adding one, as if only one step could be in flight",
            old="request.num_output_placeholders += 1",
            new="request.num_output_placeholders = 1",
        ),
        Mutant(
            "skips_the_base_update",
            "forgets the synchronous scheduler's update, so the step's tokens are never counted as computed",
            old="        super()._update_after_schedule(scheduler_output)\n",
            new="",
        ),
    ],
    "ch14_t2": [
        Mutant(
            "caches_the_steps_in_flight",
            "caches up to num_computed_tokens, which counts the steps still in flight and their placeholders",
            old="request, request.num_computed_tokens - request.num_output_placeholders",
            new="request, request.num_computed_tokens",
        ),
        Mutant(
            "caches_the_token_just_sampled",
            "caches up to num_tokens, the token that just arrived included, whose KV no finished step wrote",
            old="request, request.num_computed_tokens - request.num_output_placeholders",
            new="request, request.num_tokens",
        ),
        Mutant(
            "keeps_the_placeholder",
            "never takes a placeholder back, so the scheduler keeps counting tokens that have arrived",
            old="        request.num_output_placeholders -= len(new_token_ids)\n",
            new="",
        ),
        Mutant(
            "caches_a_preempted_request",
            "caches every request that did not stop, one preempted with a step in flight (no blocks) too",
            old="if status_before_update == RequestStatus.RUNNING:",
            new="if not stopped:",
        ),
    ],
    "ch14_t3": [
        Mutant(
            "waits_every_step",
            "never returns early: it waits for each step right after launching it, and nothing overlaps",
            old=(
                "            if model_executed and len(batch_queue) < self.batch_queue_size "
                "and not batch_queue[-1][0].done():\n"
                "                return None\n"
            ),
            new="",
        ),
        Mutant(
            "updates_the_newest_step",
            "pops the step just launched instead of the oldest, so steps are updated out of order",
            old="future, scheduler_output = batch_queue.pop()",
            new="future, scheduler_output = batch_queue.popleft()",
        ),
        Mutant(
            "ignores_a_finished_step",
            "returns None while the queue has room even when the oldest step is already done",
            old="len(batch_queue) < self.batch_queue_size and not batch_queue[-1][0].done()",
            new="len(batch_queue) < self.batch_queue_size",
        ),
        Mutant(
            "leaves_an_empty_step_in_flight",
            "returns early after a step of no tokens too, instead of waiting for the oldest step",
            old="if model_executed and len(batch_queue)",
            new="if len(batch_queue)",
        ),
        Mutant(
            "blocks_on_each_launch",
            "launches the step without non_block=True, so execute_model returns only when the step has run",
            old="self.model_executor.execute_model(scheduler_output, non_block=True)",
            new="self.model_executor.execute_model(scheduler_output)",
        ),
        Mutant(
            "forgets_finished_ids",
            "schedules only while requests are unfinished, so finished ids never reach the runner",
            old="if self.scheduler.has_requests():",
            new="if self.scheduler.has_unfinished_requests():",
        ),
    ],
    "ch15_t1": [
        Mutant(
            "forgets_the_rollback",
            "advances each matcher over the step's drafts and leaves it there, as if they were all accepted",
            old="            if num_advanced:\n                grammar.rollback(num_advanced)\n",
            new="",
        ),
        Mutant(
            "forgets_the_draft_rows",
            "writes one row per request, none for its drafts, so the runner masks drafts with the wrong rows",
            old="for token in [*scheduled_spec_decode_tokens.get(req_id, ()), None]:",
            new="for token in [None]:",
        ),
        Mutant(
            "one_row_index_per_request",
            "off by one: moves to the next row once per request, so a request's draft rows overwrite each other",
            old="                cumulative_index += 1\n            if num_advanced:",
            new="            cumulative_index += 1\n            if num_advanced:",
        ),
        Mutant(
            "fills_after_accepting_the_draft",
            "accepts a draft before filling its row, so each row is the mask for the token after the draft",
            old=(
                "                    grammar.fill_bitmask(bitmask, cumulative_index)\n"
                "                    if token is not None:\n"
                "                        accepted = grammar.accept_tokens(req_id, [token])  # not inside the assert: python -O drops those\n"
                "                        assert accepted, \"drafts were validated on arrival\"\n"
                "                        num_advanced += 1\n"
            ),
            new=(
                "                    if token is not None:\n"
                "                        accepted = grammar.accept_tokens(req_id, [token])  # not inside the assert: python -O drops those\n"
                "                        assert accepted, \"drafts were validated on arrival\"\n"
                "                        num_advanced += 1\n"
                "                    grammar.fill_bitmask(bitmask, cumulative_index)\n"
            ),
        ),
        Mutant(
            "rolls_back_one_token",
            "rolls the matcher back by one token whatever the number of drafts it accepted",
            old="grammar.rollback(num_advanced)",
            new="grammar.rollback(1)",
        ),
        Mutant(
            "terminated_row_masks_everything",
            "fills a terminated grammar's row with zeros, forbidding every token instead of allowing every one",
            old="bitmask[cumulative_index].fill_(-1)",
            new="bitmask[cumulative_index].fill_(0)",
        ),
        Mutant(
            "dict_order",
            "takes the requests in the dict's order instead of the scheduler's (their index in its list)",
            old="sorted(structured_output_request_ids.items(), key=lambda item: item[1])",
            new="structured_output_request_ids.items()",
        ),
    ],
    "ch15_t2": [
        Mutant(
            "scheduler_index_as_logits_row",
            "puts a request's rows at its index in the scheduler's list instead of its row in the batch",
            old="logit_index = struct_out_req_batch_indices[req_id]",
            new="logit_index = scheduler_output.structured_output_request_ids[req_id]",
        ),
        Mutant(
            "drafts_do_not_shift",
            "forgets that earlier requests' drafts add logits rows, so later requests' rows are too high",
            old="        cumulative_offset += len(spec_tokens.get(req_id, ()))\n",
            new="",
        ),
        Mutant(
            "own_drafts_shift_its_rows",
            "off by one: counts a request's own drafts before placing it, so its rows start too late",
            old=(
                "        logit_index = input_batch.req_id_to_index[req_id] + cumulative_offset\n"
                "        cumulative_offset += len(spec_tokens.get(req_id, ()))\n"
            ),
            new=(
                "        cumulative_offset += len(spec_tokens.get(req_id, ()))\n"
                "        logit_index = input_batch.req_id_to_index[req_id] + cumulative_offset\n"
            ),
        ),
        Mutant(
            "only_structured_drafts_shift",
            "counts the drafts of structured requests only, though an unconstrained request's drafts have rows too",
            old=(
                "        cumulative_offset += len(spec_tokens.get(req_id, ()))\n"
                "        if req_id in scheduler_output.structured_output_request_ids:\n"
                "            struct_out_req_batch_indices[req_id] = logit_index\n"
            ),
            new=(
                "        if req_id in scheduler_output.structured_output_request_ids:\n"
                "            cumulative_offset += len(spec_tokens.get(req_id, ()))\n"
                "            struct_out_req_batch_indices[req_id] = logit_index\n"
            ),
        ),
        Mutant(
            "forgets_the_bonus_row",
            "off by one: takes one bitmask row per draft and none for the bonus token",
            old="num_rows = 1 + len(spec_tokens.get(req_id, ()))",
            new="num_rows = max(1, len(spec_tokens.get(req_id, ())))",
        ),
        Mutant(
            "masks_the_bitmask_rows",
            "applies the mask at the bitmask's row numbers, masking unconstrained requests' rows and missing others",
            old="out_indices.extend(range(logit_index, logit_index + num_rows))",
            new="out_indices.extend(range(cumulative_index, cumulative_index + num_rows))",
        ),
    ],
    "ch01_t3": [
        Mutant(
            "repetition_divides_every_logit",
            "divides a negative logit by the repetition penalty too, which makes a seen token more likely",
            old="logits.copy_(torch.where(logits > 0, logits / scale, logits * scale))",
            new="logits.copy_(logits / scale)",
        ),
        Mutant(
            "repetition_on_output_only",
            "applies the repetition penalty to output tokens only, forgetting the prompt's",
            old="seen = prompt_mask | output_mask",
            new="seen = output_mask",
        ),
        Mutant(
            "frequency_counts_the_prompt",
            "counts a prompt token once more for the frequency penalty",
            old="logits -= frequency_penalties.unsqueeze(1) * output_bin_counts",
            new="logits -= frequency_penalties.unsqueeze(1) * (output_bin_counts + prompt_mask)",
        ),
        Mutant(
            "presence_per_count",
            "subtracts the presence penalty once per time the token was sampled, not once",
            old="logits -= presence_penalties.unsqueeze(1) * output_mask",
            new="logits -= presence_penalties.unsqueeze(1) * output_bin_counts",
        ),
        Mutant(
            "repetition_on_every_token",
            "applies the repetition penalty to tokens the row has never seen",
            old="scale = torch.where(seen, repetition, 1.0)",
            new="scale = repetition",
        ),
    ],
    "ch05_t3": [
        Mutant(
            "keeps_the_previous_prompt",
            "writes a joining row's prompt tokens without clearing those of the row's previous request",
            old="                self.prompt_mask[row] = False\n",
            new="",
        ),
        Mutant(
            "keeps_the_previous_counts",
            "leaves the counts of the row's previous request in a joining row",
            old="                self.output_bin_counts[row] = 0\n",
            new="",
        ),
        Mutant(
            "counts_only_the_last_token",
            "counts the last output token at every refresh, whether new or not, and only it",
            old="new = output[self.num_counted_output_tokens[row] :]",
            new="new = output[-1:]",
        ),
        Mutant(
            "recounts_the_whole_output",
            "never records what it has counted, so every refresh counts the whole output again",
            old="            self.num_counted_output_tokens[row] = len(output)\n",
            new="",
        ),
        Mutant(
            "same_token_twice_counted_once",
            "writes instead of adding, so a token that came twice since the last refresh counts once",
            old="self.output_bin_counts.index_put_(index, ones, accumulate=True)",
            new="self.output_bin_counts.index_put_(index, ones, accumulate=False)",
        ),
        Mutant(
            "counter_not_reset_on_join",
            "keeps the counter of the row's previous request, so a joining request's first tokens go uncounted",
            old="                self.num_counted_output_tokens[row] = 0\n",
            new="",
        ),
    ],
    "ch16_t1": [
        Mutant(
            "admits_before_the_kv_arrives",
            "never checks the workers' report: the request runs on blocks whose KV has not arrived",
            old="        if request.request_id not in self.finished_recving_kv_req_ids:\n            return False\n",
            new="",
        ),
        Mutant(
            "counts_the_last_prompt_token",
            "counts every loaded token computed, so a prompt of whole blocks has nothing left to sample from",
            old="        if num_computed_tokens == request.num_tokens:\n            num_computed_tokens -= 1\n",
            new="",
        ),
        Mutant(
            "counts_whole_blocks",
            "counts the loaded blocks' slots, past the prompt's end when its last block is partly full",
            old="min(len(block_ids) * self.block_size, request.num_tokens)",
            new="len(block_ids) * self.block_size",
        ),
        Mutant(
            "blocks_not_cached",
            "never commits the loaded blocks to the prefix cache, so they are no hit for anyone, itself included",
            old="        self.kv_cache_manager.cache_blocks(request, num_computed_tokens)\n",
            new="",
        ),
        Mutant(
            "id_left_in_the_set",
            "leaves the id in finished_recving_kv_req_ids, a leak that admits a later request of that id early",
            old="        self.finished_recving_kv_req_ids.remove(request.request_id)\n",
            new="",
        ),
    ],
    "ch16_t2": [
        Mutant(
            "counts_the_last_prompt_token",
            "aligns the whole prompt instead of the tokens before its last one: a prompt of L = 16k + 1 loads a block too many",
            old="align_to_block_size(len(request.prompt_token_ids) - 1, self._block_size)",
            new="align_to_block_size(len(request.prompt_token_ids), self._block_size)",
        ),
        Mutant(
            "ignores_the_local_hit",
            "answers the whole saved prefix, counting the locally cached blocks twice",
            old="max(num_tokens_to_check - num_computed_tokens, 0)",
            new="num_tokens_to_check",
        ),
        Mutant(
            "negative_answer",
            "answers saved minus local even when the local hit reaches past the saved prefix",
            old="max(num_tokens_to_check - num_computed_tokens, 0)",
            new="num_tokens_to_check - num_computed_tokens",
        ),
        Mutant(
            "loads_without_a_save",
            "answers the aligned count even when nothing valid is saved",
            old="        if not self._found_match_for_request(request):\n            return 0, False\n",
            new="",
        ),
    ],
}
