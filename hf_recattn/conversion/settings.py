"""The settings sections of a conversion recipe, each a frozen dataclass that checks its own values
(``check(source, section)``, the messages naming ``source: section.key``): stage 1 (attention transfer), stage 2
(the training package's distillation finetune plus the data only conversion gives it), the retrieval heads and
the evaluation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..evaluation import RecallSizes
from ..prompting.needles import NEEDLE_TASKS
from ..training.checks import check_schedule, positive
from ..training.distill_settings import DistillSettings
from ..training.fused_loss import check_weighted_kl
from ..training.trainable import ATTENTION_PROJECTIONS
from .baselines import DEFAULT_BASELINES, check_baseline_names

#: the kinds of retrieval block (``retrieval_data.py``), each in the words of the training templates of its name;
#: ``needles`` draws one of the needle tasks per block, a task's own name (``multi_key``, ...) always builds that one
RETRIEVAL_KINDS = ("passkey", "codes", "words", "needles", *NEEDLE_TASKS)
#: the kinds a recipe takes in turn when it names none (``retrieval_kinds`` None)
DEFAULT_RETRIEVAL_KINDS = ("passkey", "codes", "words")


def check_kind_names(kinds: tuple[str, ...], option: str, note: str = "") -> None:
    """``kinds`` a non-empty list of ``RETRIEVAL_KINDS``; else ValueError naming ``option`` and listing them."""
    unknown = [kind for kind in kinds if kind not in RETRIEVAL_KINDS]
    if unknown or not kinds:
        raise ValueError(f"{option}: {f'unknown kind(s) {unknown}' if unknown else 'an empty list'}; "
                         f"name some of {list(RETRIEVAL_KINDS)}{note}")


def check_retrieval_kinds(kinds: tuple[str, ...] | None, share: float | None, at: str, section: str) -> None:
    """``{section}.retrieval_kinds``: None, or a non-empty list of ``RETRIEVAL_KINDS`` (taken in turn) with a
    ``retrieval_share`` > 0 to build; ValueError naming the option and listing the kinds."""
    if kinds is None:
        return
    check_kind_names(kinds, f"{at}.retrieval_kinds", " (taken in turn)")
    if not share:
        raise ValueError(f"{at}.retrieval_kinds needs {section}.retrieval_share > 0 (it chooses those blocks)")


@dataclass(frozen=True)
class Stage1Settings:
    """Attention transfer: train only the new mixer parameters to match each layer's softmax output (MSE)."""

    tokens: int = 0  # training tokens in total; 0 skips the stage
    lr: float = 1e-2
    block_size: int = 512
    batch_size: int = 4
    warmup_fraction: float = 0.05
    min_lr_fraction: float = 0.1  # cosine decay ends at lr * min_lr_fraction
    max_grad_norm: float = 1.0  # per layer
    save_every: int = 25  # optimizer steps between resumable checkpoints
    #: attention projections also trained in stage 1 (for mixers without parameters of their own, e.g.
    #: heinsen); the teacher stays frozen, only the student's copies move
    projections: tuple[str, ...] = ()
    projection_lr: float = 1e-4
    #: weight of a second term, the KL divergence (nats) from each query's softmax attention weights in the
    #: teacher to the student's (Hedgehog's objective; for mixers whose output is a weighted mean of the values,
    #: see ``Mixer.attention_weights``), against the output MSE relative to the mean square of the teacher's
    #: output (so one weight suits every layer): loss = MSE + attention_kl * mean(target^2) * KL; None or 0:
    #: outputs only
    attention_kl: float | None = None
    #: share of the blocks that hide facts in training text and ask for them (``retrieval_data.py``): the teacher's
    #: attention from the questions to the facts is what a learned cache score (``cache_score: learned``) learns from
    retrieval_share: float | None = None
    #: the kinds of those blocks, taken in turn (``RETRIEVAL_KINDS``); None: passkey, codes, words
    retrieval_kinds: tuple[str, ...] | None = None
    #: what learned cache scores (``cache_score: learned``) learn to predict: ``later`` (None; the largest weight
    #: the teacher's queries beyond the window put on a key) or ``answers`` (how much more weight the queries that
    #: answer the retrieval blocks' questions put on it than later queries on average; needs retrieval_share)
    retention_target: str | None = None

    def check(self, source: str, section: str = "stage1") -> None:
        """Raise ValueError naming ``source: section.key`` for the first value out of range."""
        at = f"{source}: {section}"
        check_schedule(self, at)
        positive(self.save_every, f"{at}.save_every")
        positive(self.projection_lr, f"{at}.projection_lr")
        if self.attention_kl is not None:
            positive(self.attention_kl, f"{at}.attention_kl", allow_zero=True)
        if self.retrieval_share is not None and not 0.0 <= self.retrieval_share < 1.0:
            raise ValueError(f"{at}.retrieval_share must be in [0, 1), got {self.retrieval_share!r}")
        check_retrieval_kinds(self.retrieval_kinds, self.retrieval_share, at, section)
        if self.retention_target not in (None, "later", "answers"):
            raise ValueError(f"{at}.retention_target: {self.retention_target!r}; choose later or answers")
        if self.retention_target == "answers" and not self.retrieval_share:
            raise ValueError(f"{at}.retention_target: answers needs {section}.retrieval_share > 0 (the blocks whose "
                             "questions it learns from)")
        bad = sorted(set(self.projections) - set(ATTENTION_PROJECTIONS))
        if bad:
            raise ValueError(f"{at}.projections: unknown {bad}; choose from {list(ATTENTION_PROJECTIONS)}")
        if not 0 <= self.min_lr_fraction <= 1:
            raise ValueError(f"{at}.min_lr_fraction must be in [0, 1]")
        if self.tokens and self.tokens < self.block_size * self.batch_size:
            raise ValueError(
                f"{at}.tokens ({self.tokens}) is less than one batch "
                f"(block_size * batch_size = {self.block_size * self.batch_size})"
            )


@dataclass(frozen=True)
class Stage2Settings(DistillSettings):
    """Stage 2: a distillation finetune (``tokens`` 0 skips it) on blocks of the training corpus, some of which may
    hide facts and ask for them."""

    #: training tokens of the corpus order passed over before stage 2's blocks begin (a run that continues from
    #: ``init`` skips the tokens the first run trained on, so that it sees fresh text)
    skip_tokens: int | None = None
    # share of the stage-2 blocks that hide facts in training text and ask for them (``retrieval_data.py``)
    retrieval_share: float | None = None
    answer_weight: float | None = None  # loss weight of those blocks' answer tokens (default 1)
    #: the kinds of those blocks, taken in turn (``RETRIEVAL_KINDS``); None: passkey, codes, words
    retrieval_kinds: tuple[str, ...] | None = None

    def check(self, source: str, section: str = "stage2") -> None:
        """Raise ValueError naming ``source: section.key`` for the first value out of range."""
        at = f"{source}: {section}"
        self._check_training(source, section)
        if self.skip_tokens is not None:
            positive(self.skip_tokens, f"{at}.skip_tokens", allow_zero=True)
            if self.skip_tokens % self.block_size:
                raise ValueError(f"{at}.skip_tokens ({self.skip_tokens}) must be a multiple of {section}.block_size "
                                 f"({self.block_size}): whole blocks are skipped")
        self._check_retrieval(at, section)
        self._check_loss(at)
        check_weighted_kl(self.loss_kernel, f"{at}.loss_kernel", self.loss,
                          f"{section}.retrieval_share" if self.retrieval_share else None)

    def _check_retrieval(self, at: str, section: str) -> None:
        share, weight = self.retrieval_share, self.answer_weight
        if share is not None and not 0 <= share < 1:
            raise ValueError(f"{at}.retrieval_share must be in [0, 1), got {share!r}")
        check_retrieval_kinds(self.retrieval_kinds, share, at, section)
        if weight is None:
            return
        if not share:
            raise ValueError(f"{at}.answer_weight needs {section}.retrieval_share > 0 (it weights those blocks)")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{at}.answer_weight must be a finite number > 0, got {weight!r}")


RETRIEVAL_HEAD_METHODS = (None, "gradient", "teacher")


@dataclass(frozen=True)
class RetrievalHeadSettings:
    """After stage 1, keep exact softmax on the KV heads recall needs (``conversion/retrieval_heads.py``)."""

    max_heads: int = 0  # at most this many KV heads in the whole model; 0 turns the step off
    context_length: int = 1024  # tokens of each recall prompt the heads are chosen on
    prompts: int = 2  # prompts of each kind: a secret number, an associative-recall fact (in training text)
    per_round: int = 2  # heads switched to exact softmax per round of the greedy search
    #: how the heads are chosen: "gradient" (None: the greedy search on the stage-1 student, retrieval_heads.py) or
    #: "teacher" (exactly max_heads, those the teacher copies answers with, teacher_heads.py)
    method: str | None = None
    #: the spec the chosen heads run instead of exact softmax (the retrieval_heads mixer's option), e.g. a hybrid
    #: window with an exact cache, so that their memory stops growing; None: exact softmax over the whole context
    retrieval: dict | None = None
    #: the kinds of retrieval prompt (``RETRIEVAL_KINDS``) the heads are chosen on, ``prompts`` of each; None: a
    #: secret number (``passkey``) and an associative-recall fact (``codes``)
    kinds: tuple[str, ...] | None = None

    def check(self, source: str, section: str = "retrieval_heads") -> None:
        at = f"{source}: {section}"
        positive(self.max_heads, f"{at}.max_heads", allow_zero=True)
        for key in ("context_length", "prompts", "per_round"):
            positive(getattr(self, key), f"{at}.{key}")
        if self.kinds is not None:
            check_kind_names(self.kinds, f"{at}.kinds")
        if self.method not in RETRIEVAL_HEAD_METHODS:
            raise ValueError(f"{at}.method must be one of {list(RETRIEVAL_HEAD_METHODS[1:])}, got {self.method!r}")
        if self.retrieval is not None:
            if not isinstance(self.retrieval, dict):
                raise ValueError(f"{at}.retrieval must be a mixer spec (a mapping), got {self.retrieval!r}")
            from ..modeling.registry import validate_spec

            validate_spec(dict(self.retrieval), f"{at}.retrieval")


@dataclass(frozen=True)
class EvalSettings:
    """The built-in evaluation after conversion."""

    quick: bool = True
    heldout_fraction: float = 0.05
    heldout_tokens: int = 8192  # held-out tokens scored by perplexity (teacher and student see the same)
    block_size: int = 512
    sample_prompt: str = "The key idea of attention is"
    sample_tokens: int = 32
    #: the recall probes' sizes over the quick / full defaults: ``evaluation.RecallSizes`` fields, e.g.
    #: ``{passkey_lengths: [1024, 4096]}``; None: the defaults
    probes: dict | None = None
    #: the untrained baselines evaluated beside the teacher and the student (``baselines.BASELINES``); None: the
    #: default (``window``, softmax over 512 tokens + 4 sinks), [] none
    baselines: tuple[str, ...] | None = None

    def baseline_names(self) -> tuple[str, ...]:
        """The baselines this evaluation runs: ``baselines``, else the default ones."""
        return DEFAULT_BASELINES if self.baselines is None else tuple(self.baselines)

    def recall_sizes(self) -> RecallSizes:
        """The recall probes this evaluation runs: ``quick``'s or the full ones, with ``probes`` over them."""
        given = {key: tuple(value) if isinstance(value, list) else value for key, value in (self.probes or {}).items()}
        return dataclasses.replace(RecallSizes.for_mode(self.quick), **given)

    def check(self, source: str, section: str = "eval") -> None:
        at = f"{source}: {section}"
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"{at}.heldout_fraction must be in (0, 1)")
        for key in ("heldout_tokens", "block_size"):
            positive(getattr(self, key), f"{at}.{key}")
        positive(self.sample_tokens, f"{at}.sample_tokens", allow_zero=True)
        check_baseline_names(self.baseline_names(), f"{at}.baselines")
        known = [f.name for f in dataclasses.fields(RecallSizes)]
        unknown = sorted(set(self.probes or {}) - set(known))
        if unknown:
            raise ValueError(f"{at}.probes: unknown key(s) {unknown}; known: {known}")
        try:
            self.recall_sizes()
        except (TypeError, ValueError) as err:
            raise ValueError(f"{at}.probes: {err}") from None
