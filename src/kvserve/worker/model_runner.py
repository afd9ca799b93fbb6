"""Loads the model, owns the paged KV pool, runs one forward pass and samples.

The KV pool is a single tensor allocated once at start-up and sized from the
cache budget. The model's attention layers are grouped by their sliding
window into KV cache groups (``core/kv_cache_groups.py``); each layer is bound
to its slice of the pool and to its group, and every step gets one attention
layout per group.

Under tensor parallelism every rank has a runner holding its share of the
model and a pool of its KV heads only, of the same number of blocks (rank
0's sizing, sent to the others). Rank 0's runner sends each step's inputs to
the other ranks before its own forward pass (``executor/worker_loop.py``
runs theirs) and alone computes logits and samples: the all-reduces leave
every rank with the same hidden states, and the LM head is replicated.

Embedding requests (``Request.is_pooling``) ride in the same flat batch: after
the forward pass their rows' hidden states are pooled into one vector each
(``layers/pooler.py``) and they sample nothing. An encoder (BERT) has no
paged attention layers: its pool holds no layers at all, and its blocks are
only the scheduler's bookkeeping of the tokens in flight, released with
each request at the end of its step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import psutil
import torch

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_groups import (
    KVCacheGroupSpec,
    cdiv,
    make_kv_cache_groups,
    num_pool_layers,
)
from kvserve.core.request import Request
from kvserve.core.scheduler import SchedulerOutput
from kvserve.distributed.group import SINGLE_RANK, TensorParallelGroup
from kvserve.kernels.quant_weight import QuantWeight
from kvserve.layers.attention import Attention
from kvserve.layers.embedding import VocabEmbedding
from kvserve.layers.linear import Linear
from kvserve.layers.pooler import pool
from kvserve.layers.weight_format import QuantizedWeights
from kvserve.loader import CachedWeights, ModelSource
from kvserve.loader.pooling_config import resolve_task
from kvserve.models.arch_config import ArchConfig
from kvserve.models.causal_lm import CausalLM
from kvserve.models.registry import build_model
from kvserve.outputs import Logprob
from kvserve.sample import Sampler, SamplingMetadata
from kvserve.sample.grammar_mask import apply_token_bitmask
from kvserve.sample.rejection_sampler import VerificationRow
from kvserve.worker.cuda_graphs import DecodeGraphs
from kvserve.worker.input_batch import ModelInputs, prepare_inputs
from kvserve.worker.kv_pool import (
    bind_kv_pool,
    kv_cache_bytes_per_block,
    num_kv_blocks,
    zeroed_pool,
)
from kvserve.worker.native_decode import NativeDecoder
from kvserve.worker.platform import FastPathInputs, device_plan
from kvserve.worker.prompt_logprobs import PromptLogprobsChunk, compute_prompt_logprobs
from kvserve.worker.spec_verify import logits_rows, sample_with_proposals

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    """Per request that sampled: its new token and, if asked, its logprobs.

    failed: the requests whose sampling raised even when sampled alone, with
        the error; they got no token. The forward pass covered them as usual.
    embeddings: per embedding request of the step, its pooled float32 vector.
    prompt_logprobs: per request that asked for prompt logprobs and computed
        prompt tokens this step, their logprobs.
    verified_token_ids, verified_logprobs: per request that verified
        speculative proposals (it is not in ``sampled_token_ids``), the tokens
        it emits (the accepted proposals, then one more) and, if asked, their
        logprobs, one entry per token.
    """

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, dict[int, Logprob]]
    failed: dict[str, Exception] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)


def physical_core_count() -> int:
    """Physical cores (hyper-threads share one core's matrix units)."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


class ModelRunner:
    """Runs the model on a :class:`SchedulerOutput` and samples the next tokens.

    tp: this process's rank among the tensor-parallel ranks (one rank by default).
    """

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        arch: ArchConfig,
        max_model_len: int,
        tp: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        self.tp = tp
        # Ranks on one host share its cores: each gets its part unless told otherwise.
        self.num_threads = config.parallel_config.num_threads or max(
            1, physical_core_count() // tp.size
        )
        torch.set_num_threads(self.num_threads)
        # Every device decision (precisions, attention backend, weight formats and kernels,
        # the decode fast path) is the plan's; see worker/platform/.
        self.plan = device_plan(config, tp)
        self.device = self.plan.device
        attention = self.plan.attention(arch, max_model_len)
        self.attention_backend = attention.backend
        self.precision = attention.precision
        self.weight_dtype = self.precision.weight_dtype
        self.dtype = self.precision.dtype
        self.kv_cache_dtype = self.precision.kv_cache_dtype
        self.block_size = config.cache_config.block_size
        self.vocab_size = arch.vocab_size
        # What the engine serves (generation, embeddings or both) and how it pools.
        model_config = config.model_config
        self.task = resolve_task(model_config.task, model_config.pooling_type, source, arch)
        self.model = build_model(arch, max_model_len, self.dtype, self.attention_backend, tp)
        weights = CachedWeights(
            source,
            arch,
            self.dtype,
            config.model_config.quantization,
            keep_quantized=self.plan.keep_quantized,
        )
        self.model.load_weights(weights)
        self.weights_origin = weights.origin
        self.model.eval().to(self.device)
        self.plan.prepare_weights(self.model, weights.repacked_cache())
        self._bind_kv_pool(config, arch, max_model_len)
        # After binding: the fast path reads each layer's pool slice and KV cache group.
        # A model without paged attention (an encoder) never decodes: it has none.
        self.fast_path = (
            None
            if self.kv_cache.numel() == 0
            else self.plan.decode_fast_path(
                FastPathInputs(
                    self.model,
                    self.attention_backend,
                    self.num_blocks,
                    config.scheduler_config.max_num_seqs,
                )
            )
        )
        # Seconds the host has waited for the device at the end of steps (0 on CPU): a
        # step's wall time less this is its host time (benchmarks/offline/engine_driver.py).
        self.device_wait_s = 0.0
        # Unseeded requests draw from this generator: the same engine seed and the
        # same submissions reproduce the same outputs.
        self.sampler = Sampler(
            torch.Generator(self.device).manual_seed(config.model_config.seed),
            self.plan.argmax_rows(),
        )

    def _bind_kv_pool(self, config: EngineConfig, arch: ArchConfig, max_model_len: int) -> None:
        """Group the attention layers by window, size the KV pool, and bind each layer to it."""
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if not layers:
            self._bookkeeping_pool(config, max_model_len)
            return
        # Layers with the same window share block tables; see core/kv_cache_groups.py.
        self.kv_cache_groups = make_kv_cache_groups([layer.sliding_window for layer in layers])
        self.sliding_windows = tuple(group.sliding_window for group in self.kv_cache_groups)
        pool_layers = num_pool_layers(self.kv_cache_groups)
        # A block's bytes over all ranks: the budget is the host's, which the ranks share.
        self.kv_bytes_per_block = kv_cache_bytes_per_block(
            arch, self.block_size, self.kv_cache_dtype, pool_layers
        )
        # Rank 0 sizes the pool (available memory differs from moment to moment).
        num_blocks = num_kv_blocks(
            config.cache_config,
            arch,
            self.kv_cache_dtype,
            max_model_len,
            config.scheduler_config.max_num_seqs,
            self.kv_cache_groups,
            config.scheduler_config.max_num_batched_tokens,
        )
        self.num_blocks: int = self.tp.broadcast_object(num_blocks)
        # [G, 2, num_blocks, block_size, Hkv / tp.size, D]. Zeroed: the null block and
        # never-written slots are read under a mask, and 0 * NaN would still be NaN.
        # Its pages become resident as blocks are first written.
        self.kv_cache = zeroed_pool(
            pool_layers,
            2,
            self.num_blocks,
            self.block_size,
            arch.num_key_value_heads // self.tp.size,
            arch.head_dim,
            dtype=self.kv_cache_dtype,
            device=self.device,
        )
        bind_kv_pool(layers, self.kv_cache_groups, self.kv_cache)

    def _bookkeeping_pool(self, config: EngineConfig, max_model_len: int) -> None:
        """A model without paged attention (an encoder): blocks that hold no memory.

        The scheduler still counts tokens in blocks; there are enough for
        ``max_num_seqs`` sequences of ``max_model_len`` tokens (or the configured
        ``num_blocks``), and each costs nothing.
        """
        self.kv_cache_groups = (KVCacheGroupSpec((), None),)
        self.sliding_windows = (None,)
        self.kv_bytes_per_block = 0
        max_num_seqs = config.scheduler_config.max_num_seqs
        num_blocks = config.cache_config.num_blocks or (
            max_num_seqs * cdiv(max_model_len, self.block_size) + 1
        )
        self.num_blocks = self.tp.broadcast_object(num_blocks)
        self.kv_cache = torch.empty(0, device=self.device)

    @property
    def native_decoder(self) -> NativeDecoder | None:
        """The fast path when it is the CPU's one-call decoder (the tests look at it)."""
        return self.fast_path if isinstance(self.fast_path, NativeDecoder) else None

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """The fast path when it is CUDA graphs (tests and the GPU check look)."""
        return self.fast_path if isinstance(self.fast_path, DecodeGraphs) else None

    def describe_precision(self) -> str:
        """E.g. ``float32``, or ``bfloat16 weights, float32 compute, bfloat16 KV cache``;
        led by the quantized types where weights keep blocks (``Q4_1, Q8_0 blocks; ...``)."""
        types = sorted({s.qtype.name for q in quantized_weights(self.model) for s in q.segments})
        described = self.precision.describe()
        return f"{', '.join(types)} blocks; otherwise {described}" if types else described

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The final hidden states ``[T, H]`` of a step's flat batch."""
        layouts = inputs.attn_layouts
        if self.fast_path is not None and self.fast_path.applies(layouts):
            return self.fast_path.run(inputs.input_ids, inputs.positions, layouts)
        # Once per step, per KV cache group, whatever the attention backend needs (masks, ...).
        attn_metadata = self.attention_backend.build_metadata(layouts, self.dtype, self.num_blocks)
        return self.model(inputs.input_ids, inputs.positions, attn_metadata)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        inputs = prepare_inputs(
            scheduler_output.scheduled, self.block_size, self.device, self.sliding_windows
        )
        if self.tp.size > 1:
            # The other ranks need the flat tensors only, not the requests behind them.
            self.tp.broadcast_object(
                dataclasses.replace(
                    inputs,
                    sampling_requests=[],
                    scheduled=[],
                    prompt_logprob_rows=(),
                    spec_token_ids=None,
                )
            )
        # The sampling tensors are built before the forward pass is queued: on a GPU their
        # copies to the device would otherwise wait for the whole pass (a blocking copy
        # synchronizes the stream), and the host's work here overlaps the device's.
        metadata = self._sampling_metadata(inputs.sampling_requests)
        hidden = self.forward(inputs)
        embeddings = self._pool(hidden, inputs)
        prompt_logprobs = {}
        if inputs.prompt_logprob_rows:
            assert isinstance(self.model, CausalLM), "only decoders have prompt logprobs"
            prompt_logprobs = compute_prompt_logprobs(
                hidden, inputs.prompt_logprob_rows, self.model.compute_logits, self.vocab_size
            )
        if not inputs.sampling_requests:
            self.device_wait_s += self.plan.wait_for_device()
            return ModelRunnerOutput({}, {}, embeddings=embeddings, prompt_logprobs=prompt_logprobs)
        assert isinstance(self.model, CausalLM), "only decoders sample"
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [N, V] float32
        if inputs.spec_token_ids is not None:
            output = self._sample_with_proposals(logits, inputs, embeddings)
            output.prompt_logprobs = prompt_logprobs
            return output
        try:
            if metadata is None:
                raise ValueError("the step's sampling tensors could not be built")
            output = self._sample(logits, inputs.sampling_requests, metadata)
        except Exception:
            # One row (its parameters, its logprobs) can fail the whole batch. The
            # logits are computed already: sample each row alone, so that only the
            # rows that fail by themselves lose their request.
            logger.warning("sampling the batch failed; sampling each row alone", exc_info=True)
            output = self._sample_rows_apart(logits, inputs.sampling_requests)
        output.embeddings = embeddings
        output.prompt_logprobs = prompt_logprobs
        return output

    def _sample_with_proposals(
        self, logits: torch.Tensor, inputs: ModelInputs, embeddings: dict[str, list[float]]
    ) -> ModelRunnerOutput:
        """Sample a step in which some requests verify proposals (``spec_verify.py``).

        If the batch fails, each request is sampled alone with its own rows, so
        that only the requests that fail by themselves are lost.
        """
        requests, spec = inputs.sampling_requests, inputs.spec_token_ids
        assert spec is not None
        rows = logits_rows(requests, spec)
        _mask_grammar_rows(logits, rows.rows)
        try:
            steps = [
                sample_with_proposals(self.sampler, logits, requests, spec, rows, self.vocab_size)
            ]
            failed: dict[str, Exception] = {}
        except Exception:
            logger.warning("sampling the batch failed; sampling each request alone", exc_info=True)
            steps, failed, start = [], {}, 0
            for request, proposals in zip(requests, spec, strict=True):
                end = start + len(proposals) + 1
                alone = logits_rows([request], [proposals])
                try:
                    steps.append(
                        sample_with_proposals(
                            self.sampler,
                            logits[start:end],
                            [request],
                            [proposals],
                            alone,
                            self.vocab_size,
                        )
                    )
                except Exception as exc:
                    failed[request.request_id] = exc
                start = end
        self.device_wait_s += self.plan.wait_for_device()
        output = ModelRunnerOutput({}, {}, failed=failed, embeddings=embeddings)
        for step in steps:
            output.sampled_token_ids.update(step.sampled_token_ids)
            output.logprobs.update(step.logprobs)
            output.verified_token_ids.update(step.verified_token_ids)
            output.verified_logprobs.update(step.verified_logprobs)
        return output

    def _pool(self, hidden: torch.Tensor, inputs: ModelInputs) -> dict[str, list[float]]:
        """The pooled vector of each embedding request of the step (hidden: ``[T, H]``)."""
        starts, lengths, sizes, ids = [], [], [], []
        row = 0
        for item in inputs.scheduled:  # in flat-batch order
            request = item.request
            if request.pooling_params is not None:
                starts.append(row)
                lengths.append(item.num_new_tokens)
                sizes.append(request.pooling_params.dimensions)
                ids.append(request.request_id)
            row += item.num_new_tokens
        if not ids:
            return {}
        pooling = self.task.pooling
        if pooling is None:
            raise ValueError("this model takes no embedding requests (task is not 'embed')")
        vectors = pool(hidden, starts, lengths, pooling, sizes)
        return {i: v.tolist() for i, v in zip(ids, vectors, strict=True)}

    def _sampling_metadata(self, requests: list[Request]) -> SamplingMetadata | None:
        """The step's sampling tensors; None when there are no rows, or when some row's
        parameters fail them (the rows are then sampled apart, each with its own)."""
        if not requests:
            return None
        try:
            return SamplingMetadata.from_requests(requests, self.vocab_size, self.device)
        except Exception:
            return None

    def _sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        metadata: SamplingMetadata | None = None,
    ) -> ModelRunnerOutput:
        """Sample the rows of ``logits`` [N, V], row i for ``requests[i]`` (with ``metadata``
        built from ``requests`` beforehand, or here)."""
        _mask_grammar_rows(logits, requests)
        if metadata is None:
            metadata = SamplingMetadata.from_requests(requests, self.vocab_size, self.device)
        sampled = self.sampler(logits, metadata)
        self.device_wait_s += self.plan.wait_for_device()
        token_ids = sampled.sampled_token_ids.tolist()
        output = ModelRunnerOutput(
            {r.request_id: t for r, t in zip(requests, token_ids, strict=True)}, {}
        )
        if sampled.logprobs is not None:
            ids = sampled.logprobs.token_ids.tolist()
            values = sampled.logprobs.logprobs.tolist()
            ranks = sampled.logprobs.sampled_ranks.tolist()
            for row, request in enumerate(requests):
                num_top = request.sampling_params.logprobs
                if num_top is None:
                    continue
                entry = {ids[row][0]: Logprob(values[row][0], ranks[row])}
                for rank, column in enumerate(range(1, num_top + 1), start=1):
                    entry.setdefault(ids[row][column], Logprob(values[row][column], rank))
                output.logprobs[request.request_id] = entry
        return output

    def _sample_rows_apart(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> ModelRunnerOutput:
        """Like :meth:`_sample`, one row at a time; a row that raises is reported, not raised.

        Greedy and seeded rows get the tokens the batch would have given them
        (no step of sampling mixes rows, and a seeded row draws from its own
        generator); unseeded random rows draw again from the shared generator.
        """
        output = ModelRunnerOutput({}, {})
        for row, request in enumerate(requests):
            try:
                alone = self._sample(logits[row : row + 1], [request])
            except Exception as exc:
                output.failed[request.request_id] = exc
                continue
            output.sampled_token_ids.update(alone.sampled_token_ids)
            output.logprobs.update(alone.logprobs)
        return output


def _mask_grammar_rows(
    logits_NV: torch.Tensor, requests: Sequence[Request | VerificationRow]
) -> None:
    """Forbid, in place, the tokens each constrained row's grammar does not allow next.

    Before the sampler: greedy rows' argmax, logprobs and the random draw all see
    the masked logits (logprobs are those of the constrained distribution, as in
    vLLM). Rows without a grammar cost nothing.
    """
    rows = [row for row, request in enumerate(requests) if request.grammar is not None]
    if not rows:
        return
    num_tokens = max(request.grammar.num_tokens for request in requests if request.grammar)
    bitmask_RW = torch.full((len(rows), (num_tokens + 31) // 32), -1, dtype=torch.int32)
    for index, row in enumerate(rows):
        grammar = requests[row].grammar
        assert grammar is not None
        grammar.fill_bitmask(bitmask_RW, index)
    apply_token_bitmask(logits_NV, bitmask_RW, torch.tensor(rows, device=logits_NV.device))


def quantized_weights(model: torch.nn.Module) -> list[QuantWeight]:
    """The weights of ``model`` kept in quantized blocks (projections, a token embedding)."""
    found = []
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.format, QuantizedWeights):
            found.append(module.format.qweight)
        elif isinstance(module, VocabEmbedding) and module.qweight is not None:
            found.append(module.qweight)
    return found
