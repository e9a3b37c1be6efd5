"""RecAttnConfig: a LlamaConfig whose attention is chosen per layer by mixer specs, and the reader of a
checkpoint's config.json."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from transformers import LlamaConfig

from .architecture import check_architecture
from .mixers import mixer_class, validate_spec
from .registry import position_need
from .serving import expose_architecture

DEFAULT_SPEC: dict[str, Any] = {"mixer": "softmax"}
#: the fields the per-layer specs follow from: setting one drops the resolved specs
SPEC_INPUTS = frozenset({"attention", "attention_overrides", "num_hidden_layers"})
#: rope types whose frequencies follow the sequence length past the original context (transformers' dynamic NTK):
#: every rotation, the window's included, changes with the length, so such a model needs positions
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic"})

# transformers serve looks the model class up under this name on the transformers module (serving.py)
expose_architecture("RecAttnForCausalLM")


def override_layers(key: str, num_layers: int, section: str = "attention_overrides") -> list[int]:
    """Layers selected by an override key: "3", "-1", "every:4" (3, 7, ...), "every:4:0" (0, 4, ...); errors name
    ``section[key]``."""
    where = f"{section}[{key!r}]"
    if key.startswith("every:"):
        parts = key.split(":")[1:]
        try:
            period = int(parts[0])
            offset = int(parts[1]) if len(parts) > 1 else period - 1
        except (ValueError, IndexError):
            raise ValueError(f"{where}: expected 'every:N' or 'every:N:OFFSET' with integers") from None
        if period < 1 or not 0 <= offset < period or len(parts) > 2:
            raise ValueError(f"{where}: need N >= 1 and 0 <= OFFSET < N")
        return [i for i in range(num_layers) if i % period == offset]
    try:
        index = int(key)
    except ValueError:
        raise ValueError(f"{where}: a key is a layer index or 'every:N[:OFFSET]'") from None
    if not -num_layers <= index < num_layers:
        raise ValueError(f"{where}: layer index out of range for {num_layers} layers")
    return [index % num_layers]


def override_order(overrides: dict) -> list:
    """The keys of an overrides mapping in the order they apply: patterns first, explicit indices last (so that
    they win)."""
    return sorted(overrides, key=lambda k: not str(k).startswith("every:"))


def resolve_layer_specs(attention: Any, overrides: dict | None, num_layers: int) -> list[dict[str, Any]]:
    """Expand (one spec or a list) plus overrides into one validated spec per layer."""
    if isinstance(attention, list):
        if len(attention) != num_layers:
            raise ValueError(
                f"attention: a list needs one spec per layer ({num_layers}), got {len(attention)}"
            )
        raw = [copy.deepcopy(s) for s in attention]
    else:
        raw = [copy.deepcopy(attention) for _ in range(num_layers)]
    overrides = overrides or {}
    if not isinstance(overrides, dict):
        raise ValueError(
            f"attention_overrides must be a dict of layer key -> spec, got {type(overrides).__name__}"
        )
    for key in override_order(overrides):
        for i in override_layers(str(key), num_layers):
            raw[i] = copy.deepcopy(overrides[key])
    return [validate_spec(spec, f"layer {i}") for i, spec in enumerate(raw)]


def _check_teacher_kv_windows(windows: Any, num_layers: int) -> None:
    """ValueError naming ``teacher_kv_windows`` unless it is None or one window (an int >= 2) or None per layer."""
    if windows is None:
        return
    if not isinstance(windows, list) or len(windows) != num_layers:
        raise ValueError(f"teacher_kv_windows must list one entry per layer ({num_layers}), got {windows!r}")
    bad = [w for w in windows if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 2)]
    if bad:
        raise ValueError(f"teacher_kv_windows: each entry is a sliding window (an int >= 2) or None, got {bad[0]!r}")


class RecAttnConfig(LlamaConfig):
    r"""Llama configuration plus per-layer attention mixers.

    Args:
        attention: one spec for every layer (``{"mixer": "linear", "feature_map": "hedgehog"}``), a mixer
            or preset name (``"gdn"``; ``{"mixer": "gdn", **options}`` overrides the preset's options, see
            presets.py), or a list with one spec per layer.
        attention_overrides: per-layer replacements keyed by layer index (``"0"``, ``"-1"``) or by a
            period (``"every:4"`` picks layers 3, 7, 11, ...; ``"every:4:0"`` picks 0, 4, 8, ...).
        o_proj_bias: whether the output projection has a bias; ``None`` follows ``attention_bias`` (Llama).
            Qwen2 teachers have q/k/v biases but none on o_proj: ``attention_bias=True, o_proj_bias=False``.
        norm_layout: where the block's RMSNorms sit: ``"pre"`` (Llama: before attention and MLP, weights
            ``input_layernorm`` / ``post_attention_layernorm``), ``"post"`` (OLMo 2: after them,
            ``post_attention_layernorm`` / ``post_feedforward_layernorm``) or ``"sandwich"`` (Gemma 2 / 3: both,
            ``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
            ``post_feedforward_layernorm``).
        norm_unit_offset: RMSNorms scale by ``1 + weight`` computed in float32 (Gemma) instead of ``weight``.
        qk_norm: an RMSNorm on q and k before RoPE: ``"head"`` (per head, Qwen3 / Gemma 3), ``"projection"``
            (over the whole projection, OLMo 2) or None. Weights ``self_attn.q_norm`` / ``self_attn.k_norm``.
        attention_multiplier: the softmax scale of q.k; None is ``head_dim ** -0.5``. Applied to q before the
            mixer (every mixer sees the teacher's q). Granite's ``attention_multiplier``, Gemma's
            ``query_pre_attn_scalar ** -0.5``.
        embedding_multiplier: the input embeddings (looked up or passed as ``inputs_embeds``) are multiplied by
            this, rounded to the model's dtype (Granite; Gemma's ``sqrt(hidden_size)``).
        residual_multiplier: attention and MLP outputs are multiplied by this before the residual add (Granite).
        logits_scaling: logits are divided by this (Granite).
        attn_logit_softcapping: ``cap * tanh(logits / cap)`` on the attention logits (Gemma 2); softmax and
            sliding_window layers only.
        final_logit_softcapping: the same on the output logits (Gemma 2).
        rope_layer_groups: one key of a nested ``rope_parameters`` per layer (Gemma 3: ``full_attention`` and
            ``sliding_attention`` layers rotate with different bases); None: ``rope_parameters`` is one flat set.
        recompute_cache_after: ``generate()`` drops the cache once, when the sequence first grows past this many
            tokens, and runs the whole sequence again (Phi-3: its longrope rotary switches to the long factors there,
            and Phi-3 recomputes the cached keys with them). None: never.
        prefill_block_size: a prompt longer than this, run into a cache, goes through the layers in blocks of
            this many tokens, each continuing from the cache the previous one left (the same function: every form
            continues exactly). Activations then stay O(block) and tokens/s stays flat in the prompt length.
            ``None`` or 0 runs the whole prompt at once.
        teacher_kv_windows: per layer, the sliding window of the teacher layer it was converted from (None: the
            teacher attends to the whole context there). The model never reads it: state reports
            (``state_size_report``, cards, the zoo) compare this model's state with the teacher's KV cache, which
            holds ``window - 1`` pairs in a sliding layer (Gemma 3: 15 of its 18 layers). None: a teacher without
            sliding layers, or a model not converted from one.
    """

    model_type = "recattn"
    #: the resolved per-layer specs, kept out of ``__dict__`` so that config.json and ``==`` never see them
    __slots__ = ("_resolved_specs",)

    attention: dict | list | str | None = None
    attention_overrides: dict | None = None
    o_proj_bias: bool | None = None
    prefill_block_size: int | None = 2048
    norm_layout: str = "pre"
    norm_unit_offset: bool = False
    qk_norm: str | None = None
    attention_multiplier: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_layer_groups: list[str] | None = None
    recompute_cache_after: int | None = None
    teacher_kv_windows: list[int | None] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        if self.attention is None:
            self.attention = dict(DEFAULT_SPEC)
        super().__post_init__(**kwargs)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        block = self.prefill_block_size
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 0):
            raise ValueError(f"prefill_block_size must be a positive int, 0 or None, got {block!r}")
        check_architecture(self)
        _check_teacher_kv_windows(self.teacher_kv_windows, self.num_hidden_layers)
        specs = self._specs()  # validate now, so that a bad spec fails at construction
        if self.attn_logit_softcapping is not None:
            for i, spec in enumerate(specs):
                if not mixer_class(spec["mixer"], f"layer {i}").applies_softcap:
                    raise ValueError(
                        f"attn_logit_softcapping={self.attn_logit_softcapping}: layer {i} ({spec['mixer']}) has no "
                        "attention logits to cap; only softmax and sliding_window layers apply it (keep those "
                        "layers softmax, or convert from a teacher without attention soft-capping)"
                    )

    @property
    def _rope_type_labels(self) -> list[str]:
        """The keys of a nested ``rope_parameters`` (transformers' rope validation reads them here)."""
        return sorted(set(self.rope_layer_groups or ()))

    def __setattr__(self, key: str, value: Any) -> None:
        super().__setattr__(key, value)
        if self.attribute_map.get(key, key) in SPEC_INPUTS:
            super().__setattr__("_resolved_specs", None)

    def _specs(self) -> list[dict[str, Any]]:
        """Every layer's validated spec, resolved once until ``attention``, ``attention_overrides`` or
        ``num_hidden_layers`` is set again (edit a spec list by assigning a new one, not in place)."""
        if getattr(self, "_resolved_specs", None) is None:
            self._resolved_specs = resolve_layer_specs(self.attention, self.attention_overrides, self.num_hidden_layers)
        return self._resolved_specs

    def layer_specs(self) -> list[dict[str, Any]]:
        """One validated spec (defaults filled in) per layer: a copy the caller may change."""
        return copy.deepcopy(self._specs())

    @property
    def output_bias(self) -> bool:
        """The o_proj bias actually used: ``o_proj_bias`` when set, else ``attention_bias``."""
        return self.attention_bias if self.o_proj_bias is None else bool(self.o_proj_bias)

    @property
    def layer_types(self) -> list[str]:
        """transformers' type of each layer, from its mixer: "full_attention" (softmax), "sliding_attention",
        "linear_attention" (a recurrent state), "hybrid_sliding" (a window beside a recurrent state) or "hybrid"."""
        return [mixer_class(spec["mixer"], f"layer {i}").layer_type(spec) for i, spec in enumerate(self._specs())]

    @layer_types.setter
    def layer_types(self, value: list[str] | None) -> None:
        """Derived from ``attention``: setting it (a config.json that lists them) is accepted only when it agrees."""
        if value is not None and list(value) != self.layer_types:
            raise ValueError(
                f"layer_types {list(value)} disagree with the mixers' {self.layer_types}: layer_types follow from "
                "attention / attention_overrides; change those instead"
            )

    def position_need(self) -> str | None:
        """Why this model supports sequences only up to ``max_position_embeddings``: the first layer that needs
        positions, "layer 3 (softmax): its exact softmax compares ..." (``Mixer.position_need``; a composite asks
        its parts), or a rotary whose frequencies follow the length (dynamic NTK); None when it runs at any
        length."""
        rope_types = self._rope_types()
        for i, spec in enumerate(self._specs()):
            need = position_need(spec, f"layer {i}")
            if need is None and spec.get("rope", True) and rope_types[i] in LENGTH_DEPENDENT_ROPE:
                need = f"its rope_type {rope_types[i]!r} rescales every rotation by the sequence length"
            if need is not None:
                return f"layer {i} ({spec['mixer']}): {need}"
        return None

    def length_limit(self) -> int | None:
        """The longest sequence this model supports: ``max_position_embeddings`` when some layer needs positions
        (``position_need``), else None (unbounded: no layer compares a query and a key through RoPE at a
        distance that grows with the context)."""
        if self.position_need() is None:
            return None
        return self.max_position_embeddings

    def _rope_types(self) -> list[str | None]:
        """The rope type each layer rotates with (its group's, under ``rope_layer_groups``)."""
        params = self.rope_parameters or {}
        groups = self.rope_layer_groups
        if not groups:
            return [params.get("rope_type")] * self.num_hidden_layers
        return [(params.get(group) or {}).get("rope_type") for group in groups]

    def layer_spec(self, layer_idx: int) -> dict[str, Any]:
        """The validated spec of layer ``layer_idx``: a copy the caller may change."""
        return copy.deepcopy(self._specs()[layer_idx])


def read_checkpoint_config(path: str | Path) -> RecAttnConfig:
    """The RecAttnConfig of a checkpoint folder (or of its config.json given as ``path``); ValueError naming the
    file when there is none or it is not an hf_recattn config."""
    file = Path(path)
    if not file.is_file():
        file = file / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: not a checkpoint folder (no config.json)")
    try:
        values = json.loads(file.read_text())
    except ValueError as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{file}: not a JSON object")
    if values.get("model_type") != RecAttnConfig.model_type:
        raise ValueError(f"{file}: model_type is {values.get('model_type')!r}, not {RecAttnConfig.model_type!r}: "
                         "not an hf_recattn checkpoint")
    values.pop("model_type")
    return RecAttnConfig(**values)
