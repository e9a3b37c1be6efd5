"""RecAttn models: the Llama architecture with one shared decoder block whose attention mixer is per layer."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
from huggingface_hub import create_repo
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin, GenerationMode
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.utils import can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .architecture import (
    NORM_LAYOUTS,
    PositionEmbeddings,
    block_norms,
    layer_rope,
    qk_norms,
    rms_norm,
    rotary_embedding,
    slice_rope,
    soft_cap,
)
from .cache import CACHE_NAME, RecAttnCache, cache_of, passed_cache
from .compiled_step import compile_decode
from .configuration import RecAttnConfig
from .decode_layout import apply_decode_layout, laid_out, project, restore_row_major
from .mixer_base import MixerInputs, MixerShape
from .mixers import build_mixer, mixer_class
from .packing import PackedDocuments, find_documents, positions_from_cu_seqlens
from .serving import RefuseContinuousBatching


def rotate_queries_and_keys(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary embedding of q [B, H, T, D] and k [B, Hkv, T, D] (cos / sin [B, T, D]), run once over both
    heads stacked: the same elementwise arithmetic as transformers' ``apply_rotary_pos_emb``, half the ops. With
    cos / sin narrower than D (partial rotary, Phi-3) only the first dimensions rotate; the rest pass through."""
    both = torch.cat([q, k], dim=1)
    if cos.shape[-1] < both.shape[-1]:
        rotary = cos.shape[-1]
        rotated_q, rotated_k = rotate_queries_and_keys(q[..., :rotary], k[..., :rotary], cos, sin)
        return torch.cat([rotated_q, q[..., rotary:]], dim=-1), torch.cat([rotated_k, k[..., rotary:]], dim=-1)
    half = both.shape[-1] // 2
    rotated = torch.cat([-both[..., half:], both[..., :half]], dim=-1)
    out = both * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    return out[:, : q.shape[1]], out[:, q.shape[1] :]


class RecAttnAttention(nn.Module):
    """Llama's q/k/v/o projections and RoPE around a pluggable mixer, with the teacher's q/k norms and attention
    scale (``config.qk_norm``, ``config.attention_multiplier``) applied before the mixer sees q and k."""

    def __init__(self, config: RecAttnConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.output_bias)
        shape = MixerShape(config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, layer_idx)
        self.mixer = build_mixer(config.layer_spec(layer_idx), shape, config)
        norms = qk_norms(config, self.num_heads, self.num_kv_heads, self.head_dim)
        if norms is not None:
            self.q_norm, self.k_norm = norms
        self.qk_norm = config.qk_norm
        # the mixers scale q.k by head_dim ** -0.5: q carries the rest of the teacher's scale (exactly 1: untouched)
        scale = config.attention_multiplier
        self.q_scale = 1.0 if scale is None else float(scale) * self.head_dim**0.5
        self.rope_group = config.rope_layer_groups[layer_idx] if config.rope_layer_groups else None
        self._fused: dict = {}  # the q/k/v product over the decode layout (decode_layout.py)

    def project(
        self, hidden_states: torch.Tensor, position_embeddings: PositionEmbeddings
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B,H,T,D], k and v [B,Hkv,T,D], rotary-embedded unless the spec says rope=False."""
        q, k, v, _ = self._project(hidden_states, position_embeddings)
        return q, k, v

    def _project(
        self, hidden_states: torch.Tensor, position_embeddings: PositionEmbeddings
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``project``, plus the mixer's own input products when the decode layout computed them with q/k/v
        (by name, see ``Mixer.input_weights``; empty otherwise)."""
        b, t, _ = hidden_states.shape
        extra = self.mixer.input_weights()
        outputs = project((self.q_proj, self.k_proj, self.v_proj), hidden_states, self._fused, list(extra.values()))
        q, k = self._queries_and_keys(outputs[0], outputs[1], position_embeddings)
        v = outputs[2].view(b, t, -1, self.head_dim).transpose(1, 2)
        return q, k, v, dict(zip(extra, outputs[3:], strict=False))  # no products unless fused

    def _queries_and_keys(
        self, q: torch.Tensor, k: torch.Tensor, position_embeddings: PositionEmbeddings
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B,H,T,D] and k [B,Hkv,T,D] from their projections [B,T,*]: the q/k norms, RoPE unless the spec says
        rope=False, the attention scale."""
        b, t, _ = q.shape
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (x.view(b, t, -1, self.head_dim).transpose(1, 2) for x in (q, k))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.mixer.spec.get("rope", True):
            cos, sin = layer_rope(position_embeddings, self.rope_group)
            q, k = rotate_queries_and_keys(q, k, cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, k

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: PositionEmbeddings,
        padding_mask: torch.Tensor | None = None,
        past_key_values: RecAttnCache | None = None,
        packing: PackedDocuments | None = None,
        output_attentions: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention output, and the attention weights [B, H, T, keys] when ``output_attentions`` (the
        model checked that this layer's mixer has them; see ``check_attention_outputs``), else None."""
        if past_key_values is None or packing is not None:
            return self.attend(hidden_states, position_embeddings, padding_mask, packing, output_attentions)
        layer = past_key_values.layers[self.layer_idx]
        q, k, v, projected = self._project(hidden_states, position_embeddings)
        inputs = MixerInputs(
            hidden_states=hidden_states,
            padding_mask=padding_mask,
            past_length=layer.get_seq_length(),
            projected=projected or None,
            output_attentions=output_attentions,
        )
        out, state = self.mixer(q, k, v, inputs, state=layer.state, use_cache=True)
        layer.update(state, hidden_states.shape[1])
        return self._output(out, hidden_states), inputs.attention_probs

    def attend(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: PositionEmbeddings,
        padding_mask: torch.Tensor | None = None,
        packing: PackedDocuments | None = None,
        output_attentions: bool = False,
        mixer_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A fresh sequence without a cache (training, scoring; stage 1 of conversion runs single layers through
        it): the output after ``o_proj``, and attention weights [B, H, T, T] or None: those ``output_attentions``
        asks for, or with ``mixer_weights`` the mixer's ``attention_weights`` (None where it has none).

        q/k/v carry an autograd graph only where their weights or the input need one (a frozen layer fed detached
        inputs builds none before the mixer)."""
        q, k, v, projected = self._project(hidden_states, position_embeddings)
        if packing is not None:
            mixed = self._mix_documents(q, k, v, hidden_states, packing).flatten(2)
            return self.o_proj(mixed.to(hidden_states.dtype)), None
        inputs = MixerInputs(
            hidden_states=hidden_states,
            padding_mask=padding_mask,
            projected=projected or None,
            output_attentions=output_attentions,
        )
        out, _ = self.mixer(q, k, v, inputs)
        weights = self.mixer.attention_weights(q, k, inputs) if mixer_weights else inputs.attention_probs
        return self._output(out, hidden_states), weights

    def log_attention_weights(
        self, hidden_states: torch.Tensor, position_embeddings: PositionEmbeddings
    ) -> torch.Tensor:
        """[B, H, T, T] float32: the log of this layer's softmax attention weights on a fresh sequence, for
        softmax-family mixers (their scale, soft-cap and window, RoPE or NoPE as the layer applies them). Only q and
        k are computed."""
        q, k = self._queries_and_keys(self.q_proj(hidden_states), self.k_proj(hidden_states), position_embeddings)
        log_weights = self.mixer.log_attention_weights(q, k, MixerInputs(hidden_states=hidden_states))
        if log_weights is None:
            raise ValueError(f"layer {self.layer_idx} ({self.mixer.name}) has no softmax attention weights")
        return log_weights

    def _output(self, out: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The mixer's [B, T, H, E] through ``o_proj``; float32 states give float32 outputs in a half-precision
        model: back to the projection's dtype first."""
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).to(hidden_states.dtype))

    def _mix_documents(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        hidden_states: torch.Tensor,
        packing: PackedDocuments,
    ) -> torch.Tensor:
        """[B, T, H, E]: the mixer run uncached on each packed document alone (see ``packing.py``)."""
        outputs = []
        for group in packing.groups:
            inputs = MixerInputs(hidden_states=group.take(hidden_states), padding_mask=group.padding_mask)
            out, _ = self.mixer(group.take_heads(q), group.take_heads(k), group.take_heads(v), inputs)
            outputs.append(out)
        return packing.merge(outputs)


class RecAttnMLP(LlamaMLP):
    """Llama's SwiGLU MLP; gate and up run as one product over the decode layout."""

    def __init__(self, config: RecAttnConfig) -> None:
        super().__init__(config)
        self._fused: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project((self.gate_proj, self.up_proj), x, self._fused)
        return self.down_proj(self.act_fn(gate) * up)


class RecAttnDecoderLayer(GradientCheckpointingLayer):
    """The one decoder block: mixer attention and a gated MLP, each with a residual, and RMSNorms where
    ``config.norm_layout`` puts them (Llama: before each); ``config.residual_multiplier`` scales both branches."""

    def __init__(self, config: RecAttnConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = RecAttnAttention(config, layer_idx)
        self.mlp = RecAttnMLP(config)
        for name, norm in block_norms(config).items():
            self.add_module(name, norm)
        self.norm_roles = NORM_LAYOUTS[config.norm_layout]
        self.residual_multiplier = float(config.residual_multiplier)

    def _norm(self, role: str, hidden_states: torch.Tensor) -> torch.Tensor:
        name = self.norm_roles.get(role)
        return hidden_states if name is None else getattr(self, name)(hidden_states)

    def _branch(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings: PositionEmbeddings, **kwargs: Any
    ) -> torch.Tensor:
        """``kwargs``: the attention's (padding_mask, past_key_values, packing, output_attentions)."""
        out, _ = self.self_attn(self._norm("attention_in", hidden_states), position_embeddings, **kwargs)
        hidden_states = hidden_states + self._branch(self._norm("attention_out", out))
        out = self._norm("mlp_out", self.mlp(self._norm("mlp_in", hidden_states)))
        return hidden_states + self._branch(out)


#: writes README.md into a saved checkpoint folder for ``push_to_hub``: ``(folder, repo_id, tags)``. hf_recattn sets
#: it to its model-card renderer; without the package (trust_remote_code) transformers' generic card is used.
MODEL_CARD_WRITER: Callable[[str, str, list[str] | None], None] | None = None


class RecAttnPreTrainedModel(PreTrainedModel):
    config_class = RecAttnConfig
    config: RecAttnConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RecAttnDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = False
    # padding-free batches (position_ids restarting per document) run natively: each document on its own
    _supports_attention_backend = True
    # per instance (``RecAttnForCausalLM.__init__``): a model whose layers all keep a KV cache can roll back rejected
    # draft tokens (assisted / speculative generation); any recurrent or window layer makes it stateful
    _is_stateful = False
    # attentions: the second output of RecAttnAttention (softmax-family layers; the others refuse)
    _can_record_outputs = {"hidden_states": RecAttnDecoderLayer, "attentions": RecAttnAttention}

    def tensor_parallel_refusal(self) -> str | None:
        """Why this model cannot be split by the tensor-parallel plan, or None. The plan splits q/k/v by heads;
        only mixers that work on any subset of heads (plain softmax and sliding window) run under it."""
        if self.config.qk_norm == "projection":
            return ("tensor parallelism: qk_norm='projection' (OLMo 2) normalizes q and k over all heads at once, "
                    "which the plan splits across ranks")
        base = self.base_model
        for i, layer in enumerate(base.layers):
            mixer = layer.self_attn.mixer
            problem = mixer.tensor_parallel_problem()
            if problem is not None:
                return (
                    f"tensor parallelism: layer {i} ({mixer.name}) cannot be split across ranks: {problem}; "
                    "only softmax and sliding_window layers without forget run under the tensor-parallel plan"
                )
        return None

    def position_need(self) -> str | None:
        """``config.position_need()`` of the layers this model was built with (found once, at construction): the
        first layer that needs positions and why, or None when the model runs at any length."""
        return self.base_model.built_position_need

    def length_limit(self) -> int | None:
        """The longest sequence this model supports: ``max_position_embeddings`` when a layer needs positions
        (``position_need``), else None (unbounded: generate and cached forwards run past it)."""
        return None if self.position_need() is None else self.config.max_position_embeddings

    def _resolve_parallel_plans(self, distributed_config: Any) -> Any:
        """transformers' plan resolution (``from_pretrained(..., tp_plan="auto")``), refused up front for mixers
        the plan cannot split (``tensor_parallel_refusal``)."""
        if (getattr(distributed_config, "tp_size", 1) or 1) > 1 and (refusal := self.tensor_parallel_refusal()):
            raise ValueError(refusal)
        return super()._resolve_parallel_plans(distributed_config)

    def __init__(self, config: RecAttnConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if not all(mixer_class(spec["mixer"], "attention").has_attention_weights for spec in config.layer_specs()):
            # what this instance can record (transformers registers the class's list, read by the capture hooks)
            self._can_record_outputs = {"hidden_states": RecAttnDecoderLayer}

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """``set_attn_implementation`` works: the softmax mixers read ``config._attn_implementation`` at every call
        and dispatch through transformers' attention interface (mixer_softmax.py; transformers looks for it in
        this file only)."""
        return True

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """Also name the sibling Auto classes in ``auto_map`` (transformers writes only the saved class)."""
        if self._auto_class is not None:  # registered for trust_remote_code: the runtime files are copied too
            self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **runtime_auto_map()}
        return super().save_pretrained(save_directory, *args, **kwargs)

    def push_to_hub(  # noqa: D417 - transformers' signature
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: bool | str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str | None = "50GB",
        tags: list[str] | None = None,
    ) -> Any:
        """transformers' ``push_to_hub`` (same arguments, same upload), with the project's model card."""
        options = dict(commit_message=commit_message, commit_description=commit_description, token=token,
                       revision=revision, create_pr=create_pr)
        if MODEL_CARD_WRITER is None:
            return super().push_to_hub(repo_id, private=private, max_shard_size=max_shard_size, tags=tags or [],
                                      **options)
        repo_id = create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, max_shard_size=max_shard_size)
            MODEL_CARD_WRITER(tmp, repo_id, tags)
            return self._upload_modified_files(tmp, repo_id, files_timestamps={}, **options)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        init_parameters = getattr(module, "init_parameters", None)
        if callable(init_parameters):  # mixer parameters (feature maps, gains, gates) say how they start
            init_parameters(init)


def _check_padding_mask(
    attention_mask: torch.Tensor | None, total_length: int, drop_if_all_real: bool = True
) -> torch.Tensor | None:
    """A [B, past + T] 0/1 mask becomes a bool mask, or None when every token is real.

    ``drop_if_all_real=False`` keeps the mask as given (decode steps: the check would cost a device sync per
    token, and masking is the identity on real tokens).
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be a 2D [batch, past + new tokens] padding mask, got shape "
            f"{tuple(attention_mask.shape)}; hf_recattn builds the causal structure itself"
        )
    if attention_mask.shape[1] != total_length:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[1]} tokens but the cache holds past tokens plus "
            f"the new ones: {total_length}"
        )
    mask = attention_mask.bool()
    return None if drop_if_all_real and bool(mask.all()) else mask


def _position_ids(
    padding_mask: torch.Tensor | None, past: int, seq_len: int, device: torch.device
) -> torch.Tensor:
    """Positions of the new tokens: counted over real tokens only (padding takes 0), as ``generate()`` does.

    So a left-padded row gets the same positions as the same tokens without padding, and a forward without
    ``position_ids`` agrees with ``generate()``, cached or not.
    """
    if padding_mask is None:
        return torch.arange(past, past + seq_len, device=device).unsqueeze(0)
    positions = padding_mask.long().cumsum(-1) - 1
    return positions.masked_fill(~padding_mask, 0)[:, -seq_len:]


def _check_no_cache_for_packing(past_key_values: Cache | None) -> None:
    """Packed documents run uncached: refuse a cache passed in (its state would mix or lose documents)."""
    if past_key_values is None:
        return
    held = past_key_values.get_seq_length()
    raise ValueError(
        "position_ids restart inside a row, i.e. packed documents (each run on its own, without a cache), but a "
        f"cache holding {held} tokens was passed (past_key_values); pack documents only for uncached training "
        "or scoring forwards (no past_key_values, not generate()), or give consecutive position_ids"
    )


class RecAttnModel(RecAttnPreTrainedModel):
    def __init__(self, config: RecAttnConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.layers = nn.ModuleList(RecAttnDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = rms_norm(config, config.hidden_size)
        self.rotary_emb = rotary_embedding(config)
        self.gradient_checkpointing = False
        #: why the layers built here bound the sequence length, or None (``position_need``)
        self.built_position_need = config.position_need()
        self.post_init()

    def new_cache(self) -> RecAttnCache:
        """An empty cache with one state layer per decoder layer."""
        return RecAttnCache.for_model(self)

    def _checked_cache(
        self, past_key_values: Cache | None, use_cache: bool, batch_size: int
    ) -> RecAttnCache | None:
        """The cache to use: a new one, or the given RecAttnCache once known to fit this model and batch."""
        if past_key_values is None or (
            not isinstance(past_key_values, RecAttnCache) and past_key_values.get_seq_length() == 0
        ):
            return self.new_cache() if use_cache else None
        if not isinstance(past_key_values, RecAttnCache):
            raise TypeError(
                "hf_recattn models need a RecAttnCache (model.new_cache()), got "
                f"{type(past_key_values).__name__} that already holds tokens"
            )
        kinds = [layer.self_attn.mixer.state_kind for layer in self.layers]
        past_key_values.check_compatible(kinds, id(self), batch_size)
        return past_key_values

    def check_attention_outputs(self, packing: PackedDocuments | None = None) -> None:
        """Refuse ``output_attentions=True`` where a layer has no attention weights to return (recurrent and
        hybrid mixers fold keys into a state), or for packed documents (one weight matrix per document)."""
        for i, layer in enumerate(self.layers):
            mixer = layer.self_attn.mixer
            if not mixer.has_attention_weights:
                raise ValueError(
                    f"output_attentions=True: layer {i} ({mixer.name}) has no attention weights (it does not keep "
                    "the keys it attends to); only softmax and sliding_window layers return them. Pass "
                    "output_attentions=False (and keep config.output_attentions False) for this model"
                )
        if packing is not None:
            raise ValueError(
                "output_attentions=True with packed documents (position_ids restarting inside a row) is not "
                "supported: run the documents as separate rows"
            )

    def _check_length(self, past: int, seq_len: int) -> None:
        limit = self.length_limit()
        if limit is not None and past + seq_len > limit:
            raise ValueError(
                f"{past} cached + {seq_len} new tokens exceed max_position_embeddings={limit}, the longest "
                f"sequence this model supports ({self.position_need()}); shorten the prompt or the generation"
            )

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        past_key_values = passed_cache(past_key_values, kwargs)
        output_attentions = bool(kwargs.pop("output_attentions", None) or self.config.output_attentions)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:  # rounded to the model's dtype, as Gemma scales by sqrt(hidden)
            # also embeddings passed in, which come from get_input_embeddings() unscaled (Granite scales those too;
            # Gemma's embedding module scales what it returns: the same numbers either way)
            scale = torch.tensor(self.embedding_multiplier, dtype=torch.float32).to(inputs_embeds.dtype)
            inputs_embeds = inputs_embeds * scale
        batch_size, seq_len = inputs_embeds.shape[:2]
        cache = self._checked_cache(past_key_values, bool(use_cache), batch_size)
        past = cache.get_seq_length() if cache is not None else 0
        if past_key_values is not None:  # incremental decoding (generate() always passes its cache)
            self._check_length(past, seq_len)
        padding_mask = _check_padding_mask(attention_mask, past + seq_len, drop_if_all_real=seq_len > 1)
        if position_ids is None and kwargs.get("cu_seq_lens_q") is not None:
            position_ids = positions_from_cu_seqlens(kwargs["cu_seq_lens_q"], seq_len).to(inputs_embeds.device)
        packing = None
        if position_ids is not None and seq_len > 1:
            packing = find_documents(position_ids, padding_mask, batch_size)
        if output_attentions:
            self.check_attention_outputs(packing)
        if packing is not None:
            _check_no_cache_for_packing(past_key_values)
            cache = None  # the default use_cache=True of a training forward: no cache for packed documents
        if position_ids is None:
            position_ids = _position_ids(padding_mask, past, seq_len, inputs_embeds.device)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        block = 0 if output_attentions else self._prefill_block(cache, packing, seq_len, kwargs)
        if block:
            hidden_states = self._prefill_in_blocks(hidden_states, position_embeddings, padding_mask, cache, block,
                                                    kwargs)
        else:
            kwargs["output_attentions"] = output_attentions
            hidden_states = self._layers(hidden_states, position_embeddings, padding_mask, cache, packing, kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **{CACHE_NAME: cache})

    def _layers(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: PositionEmbeddings,
        padding_mask: torch.Tensor | None,
        cache: RecAttnCache | None,
        packing: PackedDocuments | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                position_embeddings=position_embeddings,
                padding_mask=padding_mask,
                past_key_values=cache,
                packing=packing,
                **kwargs,
            )
        return hidden_states

    def _prefill_block(
        self, cache: RecAttnCache | None, packing: PackedDocuments | None, seq_len: int, kwargs: dict[str, Any]
    ) -> int:
        """Tokens per block for a long prompt run into a cache (``config.prefill_block_size``), or 0 for one pass
        (no cache, packed documents, a short prompt, or per-layer outputs being captured)."""
        block = self.config.prefill_block_size or 0
        capturing = any(kwargs.get(name) or getattr(self.config, name, False)
                        for name in ("output_hidden_states", "output_attentions"))
        if cache is None or packing is not None or capturing or seq_len <= block:
            return 0
        return block

    def _prefill_in_blocks(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: PositionEmbeddings,
        padding_mask: torch.Tensor | None,
        cache: RecAttnCache,
        block: int,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """The layers over blocks of ``block`` tokens, each continuing from the cache the previous one left."""
        seq_len = hidden_states.shape[1]
        past = padding_mask.shape[1] - seq_len if padding_mask is not None else 0
        outputs = []
        for start in range(0, seq_len, block):
            stop = min(start + block, seq_len)
            mask = None if padding_mask is None else padding_mask[:, : past + stop]
            part = slice_rope(position_embeddings, start, stop)
            outputs.append(self._layers(hidden_states[:, start:stop], part, mask, cache, None, kwargs))
        return torch.cat(outputs, dim=1)


def _fusable(layer: RecAttnDecoderLayer) -> list[tuple[tuple[nn.Module, ...], list[nn.Parameter]]]:
    """The projections of a decoder layer that share an input: q/k/v with the mixer's own input weights, and the
    MLP's gate/up."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    return [(qkv, list(attn.mixer.input_weights().values())), ((mlp.gate_proj, mlp.up_proj), [])]


def _projections(layer: RecAttnDecoderLayer) -> list[nn.Module]:
    return [m for linears, _ in _fusable(layer) for m in linears]


def runtime_auto_map() -> dict[str, str]:
    """auto_map entries for trust_remote_code, named after the flat runtime files (``modeling.py`` ...)."""
    config_file = RecAttnConfig.__module__.rsplit(".", 1)[-1]
    model_file = __name__.rsplit(".", 1)[-1]
    return {
        "AutoConfig": f"{config_file}.RecAttnConfig",
        "AutoModel": f"{model_file}.RecAttnModel",
        "AutoModelForCausalLM": f"{model_file}.RecAttnForCausalLM",
    }


def _is_empty_foreign_cache(cache: Cache) -> bool:
    """An empty transformers cache (e.g. a DynamicCache()) that generate() may replace with a RecAttnCache."""
    return not isinstance(cache, RecAttnCache) and cache.get_seq_length() == 0


class RecAttnForCausalLM(RefuseContinuousBatching, RecAttnPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Llama's plan: the base model's (config.base_model_tp_plan: q/k/v and MLP colwise, o_proj and down_proj
    # rowwise, embed_tokens by vocabulary) plus the head, sharded with the embedding it is tied to
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: RecAttnConfig) -> None:
        super().__init__(config)
        self.model = RecAttnModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self._decode_layout_pending = True
        self._is_stateful = self.rollback_refusal() is not None

    def rollback_refusal(self) -> str | None:
        """Why this model's cache cannot drop its last tokens (``cache.crop``, which assisted and speculative
        generation need to discard rejected draft tokens), or None when every layer keeps a KV cache."""
        for i, layer in enumerate(self.model.layers):
            mixer = layer.self_attn.mixer
            if (problem := mixer.rollback_problem()) is not None:
                return f"layer {i} ({mixer.name}) cannot drop tokens: {problem}"
        return None

    def _validate_generation_mode(self, generation_mode: Any, *args: Any, **kwargs: Any) -> None:
        """Refuse assisted / speculative generation before any compute where the cache cannot roll back."""
        if generation_mode == GenerationMode.ASSISTED_GENERATION and (refusal := self.rollback_refusal()):
            raise ValueError(f"assisted / speculative generation needs a cache that can roll back: {refusal}")
        super()._validate_generation_mode(generation_mode, *args, **kwargs)

    def new_cache(self) -> RecAttnCache:
        return self.model.new_cache()

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """Saved from the usual row-major storage (safetensors wants contiguous tensors); the decode layout, if
        applied, is restored afterwards."""
        if not laid_out(self):
            return super().save_pretrained(save_directory, *args, **kwargs)
        self.decode_layout(False)
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.decode_layout()

    def decode_layout(self, enable: bool = True) -> None:
        """Store the projection weights the way a CPU reads them fastest for one token at a time (q/k/v and
        gate/up fused, column-major; ``decode_layout.py``), or with ``enable=False`` back in their usual
        row-major storage. Values and parameters are unchanged. A cached one-token forward without autograd of a
        float32 model on a CPU (every ``generate()`` step) applies it once by itself; ``enable=False`` also turns
        that off. It pays in float32 only: this CPU's bfloat16 products are no faster over column-major weights."""
        self._decode_layout_pending = False
        layers = self.model.layers
        if not enable:
            modules = [
                m for layer in layers for m in (*_projections(layer), layer.self_attn.o_proj, layer.self_attn.mixer)
            ]
            restore_row_major([*modules, self.lm_head, self.model.embed_tokens])
            return
        groups = [group for layer in layers for group in _fusable(layer)]
        apply_decode_layout(groups, [*(layer.self_attn.o_proj for layer in layers), self.lm_head])

    def _maybe_decode_layout(self, input_ids: torch.Tensor | None, past_key_values: Cache | None) -> None:
        """Apply the decode layout at the first cached one-token step of a float32 model on a CPU (see
        ``decode_layout``)."""
        if (
            self._decode_layout_pending
            and past_key_values is not None
            and input_ids is not None
            and input_ids.shape[-1] == 1
            and not torch.is_grad_enabled()
            and self.lm_head.weight.device.type == "cpu"
            and self.lm_head.weight.dtype == torch.float32  # half precision reads no faster column-major here
        ):
            self.decode_layout()

    def compile_decode(self, enable: bool = True) -> list[int]:
        """Run the decode steps of the fixed-state layers through ``torch.compile`` (off by default: it compiles
        on first use; see ``compiled_step.py``). Returns the indices of the layers it applies to."""
        return compile_decode(self.model.layers, enable)

    # ----- generate() hooks ---------------------------------------------------------------------------------
    def _prepare_cache_for_generation(  # noqa: ANN001
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ):
        """generate() always decodes with a RecAttnCache (transformers' caches cannot hold mixer states)."""
        if generation_config.cache_implementation is not None:
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} is not supported: "
                f"hf_recattn models decode with their own RecAttnCache (pass {CACHE_NAME}=model.new_cache() or "
                "nothing)"
            )
        cache = model_kwargs.get(CACHE_NAME)
        if generation_config.use_cache is not False and (cache is None or _is_empty_foreign_cache(cache)):
            model_kwargs[CACHE_NAME] = self.new_cache()
        return super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )

    def prepare_inputs_for_generation(  # noqa: ANN001 - transformers' signature (generate() inspects it)
        self,
        input_ids: torch.Tensor,
        next_sequence_length=None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """transformers' inputs; once the sequence first passes ``config.recompute_cache_after`` tokens, the whole
        sequence again without the cache (the teacher's rotary changed for every cached position: Phi-3)."""
        after = self.config.recompute_cache_after
        held = cache if cache is not None else kwargs.get("past_key_values")
        if after and held is not None and input_ids.shape[1] > after and held.get_seq_length() <= after:
            cache, next_sequence_length = None, None
            kwargs.pop("past_key_values", None)
        return super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, **kwargs
        )

    def _expand_inputs_for_generation(  # noqa: ANN001, ANN003
        self, expand_size=1, is_encoder_decoder=False, input_ids=None, **model_kwargs
    ):
        """Also repeat the rows of a cache passed in (continuing with num_beams or num_return_sequences)."""
        cache = model_kwargs.get(CACHE_NAME)
        if expand_size > 1 and isinstance(cache, RecAttnCache) and input_ids is not None:
            if cache.max_batch_size == input_ids.shape[0]:
                cache.batch_repeat_interleave(expand_size)
        return super()._expand_inputs_for_generation(
            expand_size=expand_size,
            is_encoder_decoder=is_encoder_decoder,
            input_ids=input_ids,
            **model_kwargs,
        )

    def _prepare_generated_length(  # noqa: ANN001
        self, generation_config, has_default_max_length, has_default_min_length, model_input_name,
        input_ids_length, inputs_tensor
    ):
        """transformers' lengths; the default max_length (20 new tokens) is cut at max_position_embeddings only
        where the model needs positions (``length_limit``)."""
        default_max_length = generation_config.max_length
        prepared = super()._prepare_generated_length(
            generation_config, has_default_max_length, has_default_min_length, model_input_name, input_ids_length,
            inputs_tensor
        )
        if has_default_max_length and prepared.max_new_tokens is None and self.length_limit() is None:
            prepared.max_length = default_max_length + input_ids_length
        return prepared

    def _get_stopping_criteria(self, *args: Any, **kwargs: Any) -> StoppingCriteriaList:
        """transformers' criteria; its warning past max_position_embeddings only where the model needs positions."""
        criteria = super()._get_stopping_criteria(*args, **kwargs)
        for criterion in criteria:
            if isinstance(criterion, MaxLengthCriteria):
                criterion.max_position_embeddings = self.length_limit()
        return criteria

    def _validate_generated_length(  # noqa: ANN001
        self, generation_config, input_ids_length, has_default_max_length
    ):
        """Refuse, before any compute, a prompt or a max_length beyond max_position_embeddings where the model
        needs positions (``length_limit``; the error names the layer)."""
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        limit = self.length_limit()
        if limit is None:
            return
        if input_ids_length > limit:
            raise ValueError(
                f"the prompt has {input_ids_length} tokens (padding and cached tokens included) but this "
                f"model supports at most max_position_embeddings={limit} ({self.position_need()})"
            )
        if generation_config.max_length > limit:
            raise ValueError(
                f"generation would reach {generation_config.max_length} tokens (prompt {input_ids_length} + "
                f"new tokens) but this model supports at most max_position_embeddings={limit}; lower "
                f"max_new_tokens to at most {limit - input_ids_length} ({self.position_need()})"
            )

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        past_key_values = passed_cache(past_key_values, kwargs)
        self._maybe_decode_layout(input_ids, past_key_values)
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        logits = soft_cap(logits, self.config.final_logit_softcapping)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_NAME: cache_of(outputs)},
        )
