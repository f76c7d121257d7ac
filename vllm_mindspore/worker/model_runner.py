"""MindSporeModelRunner: one engine step = SchedulerOutput -> packed batch -> MindSpore graphs ->
logits -> vLLM's sampler -> ModelRunnerOutput.

Request state, block tables and sampling metadata live in vLLM's own `InputBatch` (numpy/torch on
the host); sampling, penalties, logits processors, grammars and logprobs are vLLM's own. The step
follows vLLM 0.33's two-phase contract: `execute_model` runs the model and keeps the logits,
`sample_tokens(grammar_output)` applies the structured-output bitmask and samples (random
sampling's noise drawn by the plugin's C++ kernel, `worker/sampling.py`).

The model is a `ModelBackend` (model_backends/contract.py) and runs as two MindSpore graphs: the
decoder over the step's tokens (`StepTensors`) -> hidden states, and the logits head (final
norm + LM head) over the rows that are sampled. A step of decodes (one token a request, each
sampled) runs both in one call (`ModelBackend.decode`): the head's rows are the decoder's.
The head also takes each row's argmax; a step whose requests are all plain greedy (and want no
prompt logprobs) reads only those tokens, not the logits, and skips vLLM's sampler
(`argmax_is_the_sample`).
On CPU the graphs are compiled for a fixed set of sizes (`GraphSizes`: steps are padded to the
next one) during warm-up, so no step compiles; on Ascend they are compiled once with dynamic
shapes.
"""

import bisect
import dataclasses
import time
from typing import NamedTuple

import mindspore as ms
import numpy as np
import torch
from vllm.logger import init_logger
from vllm.sampling_params import SamplingType
from vllm.utils.math_utils import cdiv
from vllm.v1.outputs import (EMPTY_MODEL_RUNNER_OUTPUT, LogprobsTensors, ModelRunnerOutput,
                              SamplerOutput)
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output.utils import apply_grammar_bitmask
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from model_backends import build_backend
from model_backends.contract import ModelBackend, StepTensors
from vllm_mindspore import envs
from vllm_mindspore.distributed.communication import expert_parallel_across_dp
from vllm_mindspore.heap import frozen_heap
from vllm_mindspore.ops import AttentionMetadata
from vllm_mindspore.patches import SAMPLER_PATCHES, apply
from vllm_mindspore.platform import ASCEND, DEVICE, precision_for
from vllm_mindspore.worker.sampling import argmax_is_the_sample

logger = init_logger("vllm.vllm_mindspore.model_runner")


def power_of_two_sizes(largest: int) -> list[int]:
    """1, 2, 4, ... up to and including `largest` (the last one may not be a power of two)."""
    sizes = [1]
    while sizes[-1] < largest:
        sizes.append(min(sizes[-1] * 2, largest))
    return sizes


class GraphSizes:
    """The shapes the graphs are compiled for. Static (CPU): token counts and logits rows are
    padded up to the next of a few sizes, each a graph compiled at warm-up (a static-shape graph
    runs 1.4-1.7x faster than a dynamic-shape one on CPU). Dynamic (Ascend): exact sizes.

    A static step whose padding would waste more than MAX_PADDING tokens runs as several graph
    calls instead (`calls`): 136 tokens as 128 + 8 rather than 256. Each call writes its tokens'
    keys and values to the cache before the next reads them, as consecutive prefill chunks do.
    An extra call costs about one weight read, the compute of ~25 tokens of this project's
    models on CPU, hence the bound. A decoder that computes nothing for padding tokens
    (`ModelBackend.skips_padding`) takes any step in one call: a wave of 7 x 128-token
    prefills ran 15% faster as one call of 1024 than as 512 + 256 + 128."""

    MAX_PADDING = 32

    def __init__(self, max_tokens: int, max_rows: int, static: bool):
        self.static = static
        self.tokens = power_of_two_sizes(max_tokens)
        self.rows = power_of_two_sizes(max_rows)

    @staticmethod
    def _pad(sizes: list[int], n: int) -> int:
        return sizes[bisect.bisect_left(sizes, n)]

    def padded_tokens(self, n: int) -> int:
        return self._pad(self.tokens, n) if self.static else n

    def padded_rows(self, n: int) -> int:
        return self._pad(self.rows, n) if self.static else n

    def calls(self, n: int, padding_is_free: bool = False) -> list[tuple[int, int]]:
        """(tokens, graph size) of each graph call of an n-token step, in order."""
        if not self.static or padding_is_free:
            return [(n, self.padded_tokens(n))]
        calls = []
        while self.padded_tokens(n) - n > self.MAX_PADDING:
            size = self.tokens[bisect.bisect_right(self.tokens, n) - 1]
            calls.append((size, size))
            n -= size
        return calls + [(n, self.padded_tokens(n))]

    @property
    def max_rows(self) -> int:
        return self.rows[-1]

    @property
    def decode_tokens(self) -> list[int]:
        """Static: the token sizes a step of decodes (at most max_rows requests) is padded to,
        a `decode` graph each. Dynamic: none (`decode` runs the two dynamic graphs in turn)."""
        if not self.static:
            return []
        return self.tokens[:bisect.bisect_left(self.tokens, self.max_rows) + 1]

    def runs_decode(self, num_tokens: int) -> bool:
        """Whether a call of num_tokens tokens may run as `decode`: any size under dynamic
        shapes, a size with a decode graph under static ones."""
        return not self.static or num_tokens in self.decode_tokens


def _padded(values: np.ndarray, size: int) -> np.ndarray:
    """values followed by zeros up to `size` (np.pad costs ~10x more on a step's few values)."""
    padded = np.zeros(size, values.dtype)
    padded[:len(values)] = values
    return padded


class PromptRows(NamedTuple):
    start: int  # first prompt position scored this step
    count: int  # rows of logits (prompt positions start .. start + count - 1)
    completes: bool  # this step reaches the end of the prompt: return the logprobs now


class GraphCall(NamedTuple):
    """One decoder graph call: `count` consecutive tokens of the step, padded to T."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    attn_metadata: AttentionMetadata
    prefill_only: bool  # every request starts its prompt this step (no cached context)
    count: int

    def step_tensors(self) -> StepTensors:
        as_tensor = ms.Tensor.from_numpy
        return StepTensors(as_tensor(self.input_ids), as_tensor(self.positions),
                           *self.attn_metadata.tensors(), self.prefill_only)


class StepInputs(NamedTuple):
    """Host arrays of one step: its graph calls (GraphSizes.calls), N rows of logits wanted."""

    calls: list[GraphCall]
    num_scheduled: np.ndarray  # [R] tokens of each request this step
    logits_index: np.ndarray  # [N]: last token of each request, then prompt-logprob tokens
    prompt_rows: dict[str, PromptRows]  # requests scoring prompt tokens this step
    # [S] int64, the requests that sample a token this step: those that reach their prompt's
    # end (a chunked prefill's earlier chunks sample nothing)
    sampling_rows: np.ndarray
    one_token_each: bool  # every request computes one token (a step of decodes)

    @property
    def padded_tokens(self) -> int:
        return sum(len(call.input_ids) for call in self.calls)


class HeadOutputs(NamedTuple):
    """The head's outputs for a step that samples a row a request and wants no prompt logprobs,
    left in MindSpore until `sample_tokens` knows whether it needs the logits or only their
    greedy tokens. Row i is request i's last token; padding rows follow."""

    logits: ms.Tensor  # [P, vocab] float32, P >= the batch's requests
    tokens: ms.Tensor  # [P] int32, each row's argmax


class PendingStep(NamedTuple):
    """What execute_model leaves for sample_tokens."""

    scheduler_output: object
    inputs: StepInputs
    logits: torch.Tensor | HeadOutputs  # [N, vocab] float32, or the head's outputs
    start: float


class MindSporeModelRunner:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.scheduler_config = vllm_config.scheduler_config
        self.max_model_len = self.model_config.max_model_len
        self.block_size = self.cache_config.block_size
        self.precision = precision_for(self.model_config.dtype, DEVICE)
        self.device = torch.device("cpu")
        # Not `self.model`: vLLM's LLMEngine reads `model_runner.model` as a torch module at exit.
        self.backend: ModelBackend | None = None
        self.num_graphs = 0  # compiled at warm-up; a step that compiles another is logged
        self.requests: dict[str, CachedRequestState] = {}
        # req_id -> number of prompt logprobs requested (popped once the prompt is done)
        self.num_prompt_logprobs: dict[str, int] = {}
        self.pending: PendingStep | None = None
        self.log_steps = envs.VLLM_MS_LOG_STEPS

        max_num_reqs = self.scheduler_config.max_num_seqs
        logits_processors = self.model_config.logits_processors
        custom_logitsprocs = tuple(logits_processors) if logits_processors else ()
        self.input_batch = InputBatch(
            max_num_reqs=max_num_reqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            device=self.device,
            vocab_size=self.model_config.get_vocab_size(),
            block_sizes=[self.block_size],
            max_num_blocks_per_req=[cdiv(self.max_model_len, self.block_size)],
            logitsprocs=build_logitsprocs(vllm_config, self.device, False, False,
                                          custom_logitsprocs),
            logitsprocs_need_output_token_ids=bool(custom_logitsprocs),
        )
        apply(SAMPLER_PATCHES)
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)
        self.pad_across_dp = expert_parallel_across_dp(vllm_config)
        self.sizes = GraphSizes(self.scheduler_config.max_num_batched_tokens, max_num_reqs,
                                static=DEVICE != ASCEND)

    # ---- model -------------------------------------------------------------------------------
    def load_model(self) -> None:
        self.backend = build_backend(self.vllm_config, self.block_size, self.precision,
                                   static_shapes=self.sizes.static)

    def get_kv_cache_spec(self):
        return self.backend.kv_cache_spec()

    def initialize_kv_cache(self, kv_cache_config) -> None:
        self.backend.allocate_kv_cache(kv_cache_config.num_blocks)
        logger.info("KV cache: %d blocks of %d tokens", kv_cache_config.num_blocks, self.block_size)

    def warm_up(self) -> float:
        """Compile every graph the steps will use: the decoder for each token count, the
        logits head for each row count and the decoder with the head for each decode step's
        token count (static sizes), or once each (dynamic); then run one step."""
        start = time.perf_counter()
        token_sizes = self.sizes.tokens if self.sizes.static else [4]
        with frozen_heap():
            for num_tokens in token_sizes:
                self.backend.compile_step(self._dummy_call(num_tokens).step_tensors())
            if not self.sizes.static:  # Ascend's graph for steps of first prefills only
                self.backend.compile_step(
                    self._dummy_call(4)._replace(prefill_only=True).step_tensors())
            for num_rows in (self.sizes.rows if self.sizes.static else [2]):
                self.backend.compile_logits(num_rows)
            for num_tokens in self.sizes.decode_tokens:
                self.backend.compile_decode(self._dummy_call(num_tokens).step_tensors())
        compiled = time.perf_counter() - start
        # Ranks compile at their own pace; MindSpore's collectives time out long before a slow
        # peer's compile ends, so every rank waits here (vLLM's gloo world group) before the
        # first collective runs.
        from vllm.distributed.parallel_state import get_world_group

        if get_world_group().world_size > 1:
            torch.distributed.barrier(group=get_world_group().cpu_group)
        # Static sizes: a step of real tokens as large as a step gets, so that MindSpore's memory
        # for the graphs' intermediates and the kernels' scratch are allocated and first touched
        # here, not in the first requests' steps (vLLM's runners warm up with a batch of
        # max_num_batched_tokens too). A call of padding computes nothing (`skips_padding`).
        warm_up_call = (self._largest_call() if self.sizes.static
                        else self._dummy_call(token_sizes[0]))
        self._logits(self._forward([warm_up_call]), np.zeros(1, np.int64))
        self.num_graphs = self.backend.num_compiled_graphs()
        logger.info("Compiled %d decoder graph(s) (tokens %s), %d logits graph(s) and %d decode "
                    "graph(s) in %.1f s: %d graphs in all", len(token_sizes),
                    token_sizes if self.sizes.static else "dynamic",
                    len(self.sizes.rows) if self.sizes.static else 1,
                    len(self.sizes.decode_tokens), compiled, self.num_graphs)
        return time.perf_counter() - start

    def _largest_call(self) -> GraphCall:
        """The most tokens a step holds (max_num_batched_tokens, as far as the request rows'
        max_model_len each take them), as prompts of token 0 written nowhere. They attend to
        block 0, which every row of the still empty block table names: vLLM's null block,
        never handed to a request."""
        rows = self.input_batch.block_table[0].get_numpy_array().shape[0]
        per_row = self.model_config.max_model_len
        tokens = min(self.scheduler_config.max_num_batched_tokens, rows * per_row)
        counts = np.array([min(per_row, tokens - start) for start in range(0, tokens, per_row)],
                          np.int32)
        positions = np.concatenate([np.arange(count, dtype=np.int32) for count in counts])
        call = self._graph_call(np.zeros(tokens, np.int32), positions, counts,
                                np.zeros(len(counts), np.int32), self.sizes.padded_tokens(tokens))
        nowhere = np.full_like(call.attn_metadata.slot_mapping, -1)
        return call._replace(attn_metadata=call.attn_metadata._replace(slot_mapping=nowhere))

    def _dummy_call(self, num_tokens: int) -> GraphCall:
        """A call of padding tokens only (written nowhere, attending to nothing)."""
        empty = np.zeros(0, np.int32)
        return self._graph_call(empty, empty, empty, empty, num_tokens)._replace(
            count=num_tokens)

    def _forward(self, calls: list[GraphCall]) -> np.ndarray:
        """The decoder's output [tokens, hidden] over the calls' tokens, in order."""
        hidden = [self.backend.forward(call.step_tensors()).asnumpy()[:call.count]
                  for call in calls]
        return hidden[0] if len(hidden) == 1 else np.concatenate(hidden)

    def _head(self, hidden: np.ndarray, rows: np.ndarray) -> HeadOutputs:
        """The head on those rows (at most `sizes.max_rows`) of the decoder's output, padded."""
        padded = np.zeros((self.sizes.padded_rows(len(rows)), hidden.shape[1]), hidden.dtype)
        padded[:len(rows)] = hidden[rows]
        return HeadOutputs(*self.backend.logits(ms.Tensor.from_numpy(padded)))

    def _logits(self, hidden: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """Logits [len(rows), vocab] float32 of those rows of the decoder's output, the head
        run on at most `sizes.max_rows` rows at a time."""
        chunks = []
        for start in range(0, len(rows), self.sizes.max_rows):
            chunk = rows[start:start + self.sizes.max_rows]
            logits = self._head(hidden, chunk).logits.asnumpy()
            chunks.append(torch.from_numpy(logits[:len(chunk)]))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    # ---- request state -----------------------------------------------------------------------
    def _update_states(self, scheduler_output) -> None:
        """Mirror the scheduler's view in the persistent InputBatch (as vLLM's GPU runner does,
        without speculative decoding, pipeline parallelism or async scheduling)."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.num_prompt_logprobs.pop(req_id, None)
            batch.remove_request(req_id)

        scheduled = scheduler_output.num_scheduled_tokens.keys()
        cached = scheduler_output.scheduled_cached_reqs
        for req_id in batch.req_id_to_index.keys() - (scheduled - cached.resumed_req_ids):
            batch.remove_request(req_id)

        to_add: list[CachedRequestState] = []
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=new.prompt_token_ids, mm_features=[],
                sampling_params=params, generator=generator, block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens, output_token_ids=[],
                prompt_embeds=new.prompt_embeds)
            self.requests[new.req_id] = state
            if params is not None and params.prompt_logprobs is not None:
                self.num_prompt_logprobs[new.req_id] = (
                    batch.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs)
            to_add.append(state)

        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            num_output_tokens = cached.num_output_tokens[i]
            index = batch.req_id_to_index.get(req_id)
            if num_output_tokens < len(state.output_token_ids):
                del state.output_token_ids[num_output_tokens:]
                if index is not None:
                    batch.num_tokens_no_spec[index] = (batch.num_prompt_tokens[index]
                                                       + num_output_tokens)
            if req_id in cached.resumed_req_ids:
                state.block_ids = new_block_ids
            elif new_block_ids is not None:
                for ids, new_ids in zip(state.block_ids, new_block_ids):
                    ids.extend(new_ids)
            if index is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = state.num_computed_tokens
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, index)

        for state in to_add:
            batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()

    def _prepare_inputs(self, scheduler_output) -> StepInputs:
        # The host's work runs on caches each step's graph flushes (its weights and KV cache pass
        # through them): a numpy call costs 5-25 us at batch 1, 20-55 us at 64 rows. So a step of
        # decodes takes the shortest way, and the rows that sample are found here, not in
        # sample_tokens right after the graph.
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids],
                                 np.int32)
        num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int32)
        # Every request in the batch is scheduled (`_update_states`), with a token at least.
        one_token_each = scheduler_output.total_num_scheduled_tokens == num_reqs
        if one_token_each:
            query_start_loc = np.arange(num_reqs + 1, dtype=np.int32)
            request_of_token = query_start_loc[:-1]
            positions = num_computed
        else:
            query_start_loc = np.zeros(num_reqs + 1, np.int32)
            np.cumsum(num_scheduled, out=query_start_loc[1:])
            request_of_token = np.repeat(np.arange(num_reqs), num_scheduled)
            positions = (num_computed[request_of_token] + np.arange(query_start_loc[-1])
                         - query_start_loc[request_of_token]).astype(np.int32)
        input_ids = batch.token_ids_cpu[request_of_token, positions].astype(np.int32)
        sampling_rows = np.flatnonzero(
            num_computed + num_scheduled >= batch.num_tokens_no_spec[:num_reqs])
        logits_index = [query_start_loc[1:] - 1]
        prompt_rows = {}
        for req_id in self.num_prompt_logprobs:
            index = batch.req_id_to_index.get(req_id)
            if index is None:
                continue
            start = self.requests[req_id].num_computed_tokens
            remaining = self.requests[req_id].num_prompt_tokens - 1 - start
            rows = PromptRows(start, max(0, min(int(num_scheduled[index]), remaining)),
                              int(num_scheduled[index]) > remaining)
            prompt_rows[req_id] = rows
            logits_index.append(query_start_loc[index] + np.arange(rows.count, dtype=np.int32))
        if self.pad_across_dp:  # one call of the same size on every engine
            num_tokens = len(input_ids)
            sizes = [(num_tokens, self.sizes.padded_tokens(self._tokens_across_dp(num_tokens)))]
        else:
            sizes = self.sizes.calls(len(input_ids), self.backend.skips_padding)
        calls, start = [], 0
        for count, padded in sizes:
            end = start + count
            if len(sizes) == 1:
                inside, context = num_scheduled, num_computed
            else:  # each request's tokens inside [start, end), and its context before them
                inside = (np.clip(query_start_loc[1:], start, end)
                          - np.clip(query_start_loc[:-1], start, end))
                context = num_computed + np.clip(start - query_start_loc[:-1], 0, num_scheduled)
            calls.append(self._graph_call(input_ids[start:end], positions[start:end], inside,
                                          context, padded))
            start = end
        logits_index = logits_index[0] if len(logits_index) == 1 else np.concatenate(logits_index)
        return StepInputs(calls, num_scheduled, logits_index.astype(np.int64), prompt_rows,
                          sampling_rows, one_token_each)

    def _graph_call(self, input_ids, positions, num_scheduled, num_computed,
                    num_tokens) -> GraphCall:
        """A call's arrays, padded to `num_tokens` tokens (padding: token 0 at position 0,
        written to no slot, in no request)."""
        pad = num_tokens - len(input_ids)
        block_table = self.input_batch.block_table[0].get_numpy_array()
        # Static graphs take every row of the block table (fixed capacity, unused rows have no
        # tokens); dynamic ones only the step's requests.
        rows = block_table if self.sizes.static else block_table[:len(num_scheduled)]
        metadata = AttentionMetadata.build(num_scheduled, num_computed, positions, rows,
                                           self.block_size, num_tokens)
        prefill_only = (not self.sizes.static and not pad and len(num_computed) > 0
                        and not num_computed.any())
        return GraphCall(_padded(input_ids, num_tokens), _padded(positions, num_tokens), metadata,
                         prefill_only, len(input_ids))

    def _tokens_across_dp(self, num_tokens: int) -> int:
        """With expert parallel across DP engines every engine steps with the same token count
        (the MoE collectives need equal shapes): the largest of all engines."""
        if not self.pad_across_dp:
            return num_tokens
        from vllm.distributed.parallel_state import get_dp_group

        most = torch.tensor([num_tokens], dtype=torch.int64)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX,
                                     group=get_dp_group().cpu_group)
        return max(int(most.item()), 1)

    def _decodes_only(self, inputs: StepInputs) -> bool:
        """A step of one graph call, whose logits rows are its tokens in order (one token a
        request, no prompt logprobs), padded to a size `decode` was compiled for."""
        return (inputs.one_token_each and len(inputs.calls) == 1 and not inputs.prompt_rows
                and self.sizes.runs_decode(len(inputs.calls[0].input_ids)))

    def execute_dummy_batch(self) -> None:
        """Step of an idle DP engine while others run: the same collectives, no real token."""
        if self.pad_across_dp:
            self._forward([self._dummy_call(
                self.sizes.padded_tokens(self._tokens_across_dp(0)))])

    # ---- step ----------------------------------------------------------------------------------
    def execute_model(self, scheduler_output) -> ModelRunnerOutput | None:
        """Run the model on the step's tokens; sampling follows in `sample_tokens`."""
        self._update_states(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        start = time.perf_counter()
        inputs = self._prepare_inputs(scheduler_output)
        if self._decodes_only(inputs):
            call = inputs.calls[0]
            logits = HeadOutputs(*self.backend.decode(call.step_tensors()))
        elif not inputs.prompt_rows:  # a row a request (at most sizes.max_rows)
            logits = self._head(self._forward(inputs.calls), inputs.logits_index)
        else:
            logits = self._logits(self._forward(inputs.calls), inputs.logits_index)
        if self.backend.num_compiled_graphs() != self.num_graphs:
            self.num_graphs = self.backend.num_compiled_graphs()
            logger.warning("Model graph recompiled (%d graphs now) for %d tokens",
                           self.num_graphs, inputs.padded_tokens)
        self.pending = PendingStep(scheduler_output, inputs, logits, start)
        return None

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        scheduler_output, inputs, logits, start = self.pending
        self.pending = None
        batch = self.input_batch
        num_reqs = batch.num_reqs
        # A request still inside its prompt (chunked prefill) samples nothing this step: its
        # row is sampled with the others and dropped (`_sample` leaves its generator alone).
        rows = inputs.sampling_rows
        partial = set(range(num_reqs)) - set(rows.tolist()) if len(rows) < num_reqs else set()
        if (isinstance(logits, HeadOutputs) and grammar_output is None
                and argmax_is_the_sample(batch.sampling_metadata)):
            # tolist, not asnumpy: asnumpy has numpy parse the buffer's format in Python, ~25 us
            # of a batch-1 step on the caches the graph has just flushed.
            sampled_ids = np.array(logits.tokens.tolist()[:num_reqs])[:, None]  # [R, 1]
            logprobs = None
        else:
            if isinstance(logits, HeadOutputs):  # a row a request
                logits = torch.from_numpy(logits.logits.asnumpy()[:num_reqs])
            sample_logits = logits if len(logits) == num_reqs else logits[:num_reqs]
            sampler_output = self._sample(sample_logits, scheduler_output, grammar_output,
                                          partial)
            sampled_ids = sampler_output.sampled_token_ids.numpy()  # [R, 1]
            logprobs = sampler_output.logprobs_tensors
        sampled = sampled_ids.tolist()
        for i in partial:
            sampled[i] = []

        if len(rows):
            tokens = sampled_ids[rows, 0]
            ends = batch.num_tokens_no_spec[rows]
            batch.token_ids_cpu[rows, ends] = tokens
            batch.is_token_ids[rows, ends] = True
            batch.num_tokens_no_spec[rows] = ends + 1
            req_ids = batch.req_ids
            for i, token in zip(rows.tolist(), tokens.tolist()):
                self.requests[req_ids[i]].output_token_ids.append(token)

        output = ModelRunnerOutput(
            req_ids=batch.req_ids.copy(),
            req_id_to_index=batch.req_id_to_index.copy(),
            sampled_token_ids=sampled,
            logprobs=logprobs.tolists() if logprobs is not None else None,
            prompt_logprobs_dict=(self._prompt_logprobs(inputs.prompt_rows, logits[num_reqs:])
                                  if inputs.prompt_rows else {}),
            pooler_output=[],
        )
        if self.log_steps:
            logger.info("step: %d reqs, %d tokens (padded to %d, %d call(s)), %d graph(s), %.1f ms",
                        num_reqs, int(inputs.num_scheduled.sum()), inputs.padded_tokens,
                        len(inputs.calls), self.num_graphs, (time.perf_counter() - start) * 1e3)
        return output

    def _sample(self, logits: torch.Tensor, scheduler_output, grammar_output,
                partial: set[int]) -> SamplerOutput:
        """vLLM's sampler over the step's rows [R, vocab]. The `partial` rows' tokens are
        dropped, so they draw nothing from their seeded generators (a chunked prompt's tokens
        then equal an unchunked run's)."""
        batch = self.input_batch
        if grammar_output is not None:
            apply_grammar_bitmask(scheduler_output, grammar_output, batch, logits)
        metadata = batch.sampling_metadata
        if metadata.generators and partial:
            metadata = dataclasses.replace(metadata, generators={
                i: g for i, g in metadata.generators.items() if i not in partial})
        return self.sampler(logits, metadata)

    def _prompt_logprobs(self, rows: dict[str, PromptRows],
                         logits: torch.Tensor) -> dict[str, LogprobsTensors | None]:
        """Prompt logprobs of this step's prompt tokens, accumulated across prefill chunks and
        returned once the prompt is complete (vLLM's GPU runner contract)."""
        result: dict[str, LogprobsTensors | None] = {}
        offset = 0
        for req_id, (start, count, completes) in rows.items():
            state = self.requests[req_id]
            num_logprobs = self.num_prompt_logprobs[req_id]
            if state.in_progress_prompt_logprobs_cpu is None:
                state.in_progress_prompt_logprobs_cpu = LogprobsTensors.empty_cpu(
                    state.num_prompt_tokens - 1, num_logprobs + 1)
            target = state.in_progress_prompt_logprobs_cpu
            if count:
                chunk_logits = logits[offset:offset + count]
                offset += count
                if self.model_config.logprobs_mode in ("raw_logits", "processed_logits"):
                    scores = chunk_logits
                else:
                    scores = self.sampler.compute_logprobs(chunk_logits)
                targets = torch.tensor(state.prompt_token_ids[start + 1:start + 1 + count])
                token_ids, values, ranks, *_ = self.sampler.gather_logprobs(
                    scores, num_logprobs, targets)
                target.logprob_token_ids[start:start + count] = token_ids
                target.logprobs[start:start + count] = values
                target.selected_token_ranks[start:start + count] = ranks
            if completes:
                result[req_id] = target
                state.in_progress_prompt_logprobs_cpu = None
                del self.num_prompt_logprobs[req_id]
        return result
