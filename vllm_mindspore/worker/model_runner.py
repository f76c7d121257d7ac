"""MindSporeModelRunner: one engine step = SchedulerOutput -> packed batch -> MindSpore graph ->
logits -> vLLM's sampler -> ModelRunnerOutput.

Request state, block tables and sampling metadata live in vLLM's own `InputBatch` (numpy/torch on
the host); sampling, penalties, logits processors and logprobs are vLLM's own `Sampler`. Only the
forward pass is MindSpore: one graph compiled once with dynamic shapes, so steady-state steps of
any batch shape reuse it.
"""

import time
from typing import NamedTuple

import mindspore as ms
import numpy as np
import torch
from vllm.config import set_current_vllm_config
from vllm.logger import init_logger
from vllm.sampling_params import SamplingType
from vllm.utils.math_utils import cdiv
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsTensors, ModelRunnerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from model_backends import resolve_model_class, select_backend
from model_backends.native.weights import load_checkpoint, process_weights_after_loading
from vllm_mindspore import envs
from vllm_mindspore.distributed.communication import expert_parallel_across_dp
from vllm_mindspore.ops import AttentionMetadata

logger = init_logger("vllm.vllm_mindspore.model_runner")

MS_DTYPES = {torch.float32: ms.float32, torch.float16: ms.float16, torch.bfloat16: ms.bfloat16}


class PromptRows(NamedTuple):
    start: int  # first prompt position scored this step
    count: int  # rows of logits (prompt positions start .. start + count - 1)
    completes: bool  # this step reaches the end of the prompt: return the logprobs now


class StepInputs(NamedTuple):
    """Host arrays of one step. T tokens; N = rows of logits wanted."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    logits_index: np.ndarray  # [N]: last token of each request, then prompt-logprob tokens
    attn_metadata: AttentionMetadata
    query_start_loc: np.ndarray  # [B + 1]
    prompt_rows: dict[str, PromptRows]  # requests scoring prompt tokens this step


class MindSporeModelRunner:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.scheduler_config = vllm_config.scheduler_config
        self.max_model_len = self.model_config.max_model_len
        self.block_size = self.cache_config.block_size
        self.dtype = MS_DTYPES[self.model_config.dtype]
        self.device = torch.device("cpu")
        self.model = None
        self.num_compiles = 0
        self.requests: dict[str, CachedRequestState] = {}
        # req_id -> number of prompt logprobs requested (popped once the prompt is done)
        self.num_prompt_logprobs: dict[str, int] = {}

        logits_processors = self.model_config.logits_processors
        custom_logitsprocs = tuple(logits_processors) if logits_processors else ()
        self.input_batch = InputBatch(
            max_num_reqs=self.scheduler_config.max_num_seqs,
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
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)
        self.pad_across_dp = expert_parallel_across_dp(vllm_config)

    # ---- model -------------------------------------------------------------------------------
    def load_model(self) -> None:
        hf_config = self.model_config.hf_config
        backend = select_backend()
        model_cls = resolve_model_class(list(getattr(hf_config, "architectures", None) or []),
                                        backend.name)
        start = time.perf_counter()
        # vLLM's rope tables and the parallel layout (TP/EP ranks) read the current config.
        with set_current_vllm_config(self.vllm_config):
            self.model = model_cls(self.model_config.hf_text_config, self.block_size, self.dtype)
            load_checkpoint(self.model, self.model_config.model,
                            self.model.checkpoint_name_to_param)
            process_weights_after_loading(self.model)
        self.model.set_inputs(*self.model.dynamic_inputs())
        logger.info("Built %s (%s backend, %s) and loaded its weights in %.2f s",
                    model_cls.__name__, backend.name, self.dtype, time.perf_counter() - start)

    def get_kv_cache_spec(self):
        return self.model.kv_cache_spec(self.block_size, self.model_config.dtype)

    def initialize_kv_cache(self, kv_cache_config) -> None:
        self.model.allocate_kv_cache(kv_cache_config.num_blocks)
        logger.info("KV cache: %d blocks of %d tokens", kv_cache_config.num_blocks, self.block_size)

    def warm_up(self) -> float:
        """Compile the graph once on a dummy batch (two requests, decode + 3-token prefill)."""
        start = time.perf_counter()
        positions = np.array([0, 0, 1, 2], np.int32)
        query_start_loc = np.array([0, 1, 4], np.int32)
        block_table = np.zeros((2, 1), np.int32)  # block 0 is vLLM's reserved null block
        metadata = AttentionMetadata.build(positions, query_start_loc, np.zeros(2, np.int32),
                                           block_table, self.block_size)
        inputs = StepInputs(np.zeros(4, np.int32), positions, np.array([0, 3], np.int32), metadata,
                            query_start_loc, {})
        self.model.compile(*self._graph_inputs(inputs))
        # Ranks compile at their own pace; MindSpore's collectives time out long before a slow
        # peer's compile ends, so every rank waits here (vLLM's gloo world group) before the
        # first collective runs.
        from vllm.distributed.parallel_state import get_world_group

        if get_world_group().world_size > 1:
            torch.distributed.barrier(group=get_world_group().cpu_group)
        self._forward(inputs)
        seconds = time.perf_counter() - start
        logger.info("Compiled the model graph in %.2f s", seconds)
        return seconds

    @staticmethod
    def _graph_inputs(inputs: StepInputs) -> tuple:
        as_tensor = ms.Tensor.from_numpy
        return (as_tensor(inputs.input_ids), as_tensor(inputs.positions),
                as_tensor(inputs.logits_index), *inputs.attn_metadata.tensors())

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        logits = self.model(*self._graph_inputs(inputs))
        compiles = len(self.model.compile_cache)
        if compiles != self.num_compiles:
            if self.num_compiles:
                logger.warning("Model graph recompiled (%d graphs now) for %d tokens", compiles,
                               len(inputs.input_ids))
            self.num_compiles = compiles
        return torch.from_numpy(logits.asnumpy())

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
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids],
                                 np.int32)
        query_start_loc = np.zeros(num_reqs + 1, np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int32)
        request_of_token = np.repeat(np.arange(num_reqs), num_scheduled)
        positions = (num_computed[request_of_token] + np.arange(query_start_loc[-1])
                     - query_start_loc[request_of_token]).astype(np.int32)
        input_ids = batch.token_ids_cpu[request_of_token, positions].astype(np.int32)
        input_ids, positions, metadata = self._tokens_and_metadata(
            input_ids, positions, query_start_loc, num_computed,
            batch.block_table[0].get_numpy_array()[:num_reqs])
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
        return StepInputs(input_ids, positions, np.concatenate(logits_index).astype(np.int32),
                          metadata, query_start_loc, prompt_rows)

    def _tokens_and_metadata(self, input_ids, positions, query_start_loc, num_computed,
                             block_table):
        """Attention metadata of the step; with expert parallel across DP engines, the batch is
        first padded to the largest token count of any engine (the MoE collectives need equal
        shapes) by one extra request of padding tokens at position 0 in vLLM's null block 0."""
        pad = self._padding_across_dp(len(input_ids))
        if pad:
            zeros = np.zeros(pad, np.int32)
            input_ids = np.concatenate((input_ids, zeros))
            positions = np.concatenate((positions, zeros))
            query_start_loc = np.append(query_start_loc, query_start_loc[-1] + pad)
            num_computed = np.append(num_computed, 0)
            block_table = np.vstack((block_table, np.zeros((1, block_table.shape[1]), np.int32)))
        metadata = AttentionMetadata.build(positions, query_start_loc, num_computed, block_table,
                                           self.block_size)
        return input_ids, positions, metadata

    def _padding_across_dp(self, num_tokens: int) -> int:
        if not self.pad_across_dp:
            return 0
        from vllm.distributed.parallel_state import get_dp_group

        most = torch.tensor([num_tokens], dtype=torch.int64)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX,
                                     group=get_dp_group().cpu_group)
        return max(int(most.item()), 1) - num_tokens

    def execute_dummy_batch(self) -> None:
        """Step of an idle DP engine while others run: the same collectives, no real token."""
        if not self.pad_across_dp:
            return
        empty = np.zeros(0, np.int32)
        block_table = np.zeros((0, self.input_batch.block_table[0].get_numpy_array().shape[1]),
                               np.int32)
        input_ids, positions, metadata = self._tokens_and_metadata(
            empty, empty, np.zeros(1, np.int32), empty, block_table)
        self._forward(StepInputs(input_ids, positions, np.zeros(1, np.int32), metadata,
                                 np.zeros(1, np.int32), {}))

    # ---- step ----------------------------------------------------------------------------------
    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        start = time.perf_counter()
        batch = self.input_batch
        num_reqs = batch.num_reqs
        inputs = self._prepare_inputs(scheduler_output)
        num_scheduled = np.diff(inputs.query_start_loc)
        logits = self._forward(inputs)

        sampler_output = self.sampler(logits[:num_reqs], batch.sampling_metadata)
        sampled = sampler_output.sampled_token_ids.tolist()
        # A request still inside its prompt (chunked prefill) samples nothing this step.
        seq_lens = batch.num_computed_tokens_cpu[:num_reqs] + num_scheduled
        for i in np.nonzero(seq_lens < batch.num_tokens_no_spec[:num_reqs])[0]:
            sampled[i] = []
            generator = batch.generators.get(int(i))
            if generator is not None:  # undo the draw, as vLLM's GPU runner does
                generator.set_offset(generator.get_offset() - 4)

        for i, token_ids in enumerate(sampled):
            if not token_ids:
                continue
            end = batch.num_tokens_no_spec[i] + 1
            batch.token_ids_cpu[i, end - 1] = token_ids[0]
            batch.is_token_ids[i, end - 1] = True
            batch.num_tokens_no_spec[i] = end
            self.requests[batch.req_ids[i]].output_token_ids.append(token_ids[0])

        logprobs = sampler_output.logprobs_tensors
        output = ModelRunnerOutput(
            req_ids=batch.req_ids.copy(),
            req_id_to_index=batch.req_id_to_index.copy(),
            sampled_token_ids=sampled,
            logprobs=logprobs.tolists() if logprobs is not None else None,
            prompt_logprobs_dict=self._prompt_logprobs(inputs.prompt_rows, logits[num_reqs:]),
            pooler_output=[],
        )
        if envs.VLLM_MS_LOG_STEPS:
            logger.info("step: %d reqs, %d tokens, %d graph(s), %.1f ms", num_reqs,
                        len(inputs.input_ids), self.num_compiles,
                        (time.perf_counter() - start) * 1e3)
        return output

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
