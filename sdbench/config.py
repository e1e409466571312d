"""Frozen configuration objects: the one home of defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DATASET = "mt-bench"
DEFAULT_STRATEGY = "ngram"
DEFAULT_GAMMA = 4
DEFAULT_LIMIT = 4
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_OUT = "results"


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen from logits; applied identically to draft and target."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def group_seed(self, repeat: int, group: int) -> int:
        """The generator seed of one measured group (a batch of `run`, a load point of `run --request-rate`) in one
        repeat: distinct per (seed, repeat, group), the same for every role measured on it."""
        return self.seed * 1_000_003 + repeat * 10_007 + group


@dataclass(frozen=True)
class RunConfig:
    target: str = DEFAULT_TARGET
    drafts: tuple[str, ...] = ()
    strategy: str = DEFAULT_STRATEGY
    dataset: str = DEFAULT_DATASET
    limit: int = DEFAULT_LIMIT
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    batch_size: int = 1
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    gammas: tuple[int, ...] = ()  # one run per value (a sweep); empty: the preset's, else DEFAULT_GAMMA
    prompt_len: int | None = None
    device: str = "auto"
    dtype: str = "float32"
    repeats: int = 1
    options: dict = field(default_factory=dict)  # --set key=value, strategy-specific
    out: str = DEFAULT_OUT
    baseline: bool = True
    resume: str | None = None
    warmup_tokens: int = 8
    fast: bool = True  # the runner's fast path where one is measured to help (CPU: packed projections)
    turns: int | None = None  # turns of each conversation to decode; None: all of them (MT-Bench: 2)
    fields: dict = field(default_factory=dict)  # --dataset FILE: prompt / category / id -> the file's field
    depths: tuple[float, ...] = ()  # retrieval tasks: where the answer hides (0 = start, 1 = end); empty: spread
    # compare every runner's logits with the library's forward before running (models/probing/probe.py): "auto" reuses a
    # verdict kept for the same weights, dtype, device, path and code (models/probing/probe_cache.py), "always" probes
    # again, "never" skips it
    probe: str = "auto"
    # serving under load (commands/load.py): each (rate, concurrency) pair a load point; empty both: batches
    request_rates: tuple[float, ...] = ()  # requests/s of Poisson arrivals; inf = all at once
    concurrencies: tuple[int, ...] = ()  # requests in flight at most (the running batch); empty: every request
    slo: dict = field(default_factory=dict)  # metric (ttft, tpot, e2el) -> bound in ms, for goodput
    # --compare: other strategies or presets measured beside the strategy in the same run, name -> the run's own
    # settings for it (--set NAME.key=value), in the order given
    compare: dict = field(default_factory=dict)
    # `run --engine` (commands/run_engine.py): the engine whose own server decodes every role, "sdbench": its loop
    engine: str = "sdbench"
    engine_url: str | None = None  # that engine's server the user already runs (decoding as it was started)
    engine_port: int | None = None  # the first port of the servers sdbench starts (None: free ones)

    @property
    def under_load(self) -> bool:
        return bool(self.request_rates or self.concurrencies)

    @property
    def gamma(self) -> int | None:
        """The largest lookahead asked for (sizes caches and position checks)."""
        return max(self.gammas) if self.gammas else None


DEFAULT_TRIALS = 20
OBJECTIVES = ("speedup", "tokens")


@dataclass(frozen=True)
class TuneConfig:
    """`sdbench tune`: search a strategy's settings on a fixed, seeded prompt subset."""

    run: RunConfig  # target, --draft candidates, strategy, data set and subset, device; gammas/options unused
    trials: int = DEFAULT_TRIALS  # the study's total of finished trials to reach (a re-run resumes toward it)
    timeout: float | None = None  # seconds for this session: no trial starts after it
    objective: str = "speedup"  # "speedup" vs the baseline on the same prompts, or strategy "tokens"/s
    storage: str | None = None  # any Optuna storage URL; None: sqlite:///<out>/tune.db
    study: str | None = None  # study name; None: sdbench-<target>-<strategy>-<dataset>-<hardware>
    preset: str | None = None  # preset written with the best settings; None: tuned-<strategy>-<target>
    batches: tuple[int, ...] = ()  # several: one study per batch size, written as a schedule (commands/schedule.py)
    prompt_lens: tuple[int, ...] = ()  # several: one study per prompt length too (MagicDec's budget per context)
    heads: tuple[str, ...] = ()  # trained-head candidates (eagle, medusa); none: the target's recorded heads
    strategies: tuple[str, ...] = ()  # several: one study chooses among them (each trial one); none: run.strategy
    trees: bool = False  # also search the token tree's shape (the chain stays a choice) where a strategy grows trees
    per_bucket: str = "gamma"  # with --batch: what each bucket tunes, "gamma" (the rest held, as engines take) or "all"
    held: tuple[tuple[str, object], ...] = ()  # (parameter, value) every trial keeps: a schedule's later buckets


DEFAULT_HEAD_DATA = ("sharegpt", "gsm8k", "humaneval")  # never MT-Bench: the prompts heads are measured on
HEAD_ANSWERS = ("both", "target", "data")  # whose answers a head is fitted on (train-head --answers)


@dataclass(frozen=True)
class TrainHeadConfig:
    """`sdbench train-head`: fit a head on the target's own answers to prompts of shipped data sets."""

    target: str
    kind: str  # a head kind of training/kinds.py
    out: str  # the head's folder (also its data and checkpoint: a re-run resumes there)
    data: tuple[str, ...] = DEFAULT_HEAD_DATA
    minutes: float = 20.0  # the whole command's wall-clock budget: generating its data, then fitting
    prompts: int = 512  # training prompts at most (a share held out for acceptance)
    max_new_tokens: int = 128  # the target's answer to each
    answers: str = "both"  # fit on the target's answers, the data sets' own replies (read in one forward), or both
    draft_vocab: int | None = None  # the draft vocabulary's size; None: not given (min(target's, 8192)); 0: all
    steps: int | None = None  # what --steps sets for the kind (training/kinds.py); None: not given (its default)
    device: str = "auto"
    dtype: str = "auto"  # the target's while it answers: bfloat16 on a GPU, float32 on a CPU
    seed: int = 0
    probe: str = "auto"


SWEEP_AXES = ("batch", "concurrency")  # static batches of that size, or that many requests in flight under load
DEFAULT_SWEEP_SIZES = (1, 2, 4, 8)
DEFAULT_SWEEP_PROMPT_LENS = (256, 1024, 2048)
DEFAULT_SWEEP_DATASET = "pg19"  # book text cut into token-exact prompts of each --prompt-len
QUICK_SWEEP_SIZES = (1, 2, 4)
QUICK_SWEEP_PROMPT_LENS = (256, 1024)
QUICK_SWEEP_MAX_NEW_TOKENS = 32


@dataclass(frozen=True)
class BenchConfig:
    """`sdbench bench`: sdbench against transformers' generate and assisted generation, in one process."""

    target: str = DEFAULT_TARGET
    draft: str = ""  # a draft model; "" = the target drafting for itself
    dataset: str = DEFAULT_DATASET
    limit: int = DEFAULT_LIMIT
    max_new_tokens: int = 96
    gamma: int = 4
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 0
    repeats: int = 2
    out: str | None = None  # also write OUT/bench.parquet
    generate: str = "fastest"  # transformers generate's configuration (commands/hf_generate.py MODES)
    autoregressive_only: bool = False  # plain decoding alone (transformers, sdbench eager and fast, generic)
    heads: tuple[str, ...] = ()  # trained heads (folders or hub ids): one sdbench eagle/medusa row each
    tree: str = ""  # "K,NODES": also the draft model's top-K token tree of NODES nodes, gamma levels deep
    engine: str = "sdbench"  # also measure engines users deploy (servers/engines.py): llama.cpp, vllm or a comma list
    engine_url: str | None = None  # that engine's server the user already runs (measured as it runs)
    engine_port: int | None = None  # the first port of the servers sdbench starts (None: free ones)

    @property
    def draft_model(self) -> str:
        return self.draft or self.target


@dataclass(frozen=True)
class SweepConfig:
    """`sdbench sweep`: every strategy beside plain decoding at every (size, prompt length) point of a grid."""

    run: RunConfig  # the settings every point shares (target, drafts, data set, budget, gammas, device, out...);
    # its strategy, batch_size, prompt_len and concurrencies are set per point
    strategies: tuple[str, ...] = (DEFAULT_STRATEGY,)  # names or presets; each measured at every point
    axis: str = "batch"  # one of SWEEP_AXES
    sizes: tuple[int, ...] = DEFAULT_SWEEP_SIZES  # batch sizes or concurrencies
    prompt_lens: tuple[int, ...] = DEFAULT_SWEEP_PROMPT_LENS
    scoped: dict = field(default_factory=dict)  # strategy name -> its own --set NAME.key=value settings
    resume: str | None = None  # a sweep id under run.out to continue


# ---- the analysis commands (`predict`, `simulate`): their settings as the CLI gave them --------------------------


@dataclass(frozen=True)
class PredictMagicdecConfig:
    """`sdbench predict magicdec`: profile step costs over a batch x context grid, predict per (gamma, budget)."""

    target: str
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    gammas: tuple[int, ...]
    budgets: tuple[int, ...]  # draft KV budgets
    alpha: float  # where no --from run measured one
    from_results: tuple[str, ...]  # magicdec results: alpha fitted per selector, budget and prompt length
    device: str
    dtype: str
    out: str | None  # folder for the profile as Parquet; None: not written
    fast: bool = True  # time the steps through the runner decoding would use


@dataclass(frozen=True)
class PredictTreeConfig:
    """`sdbench predict tree`: the best token tree per batch size and node budget, from a run's acceptance by
    depth and rank (or a shipped table's) and the verification costs profiled on this machine."""

    results: tuple[str, ...]  # a run's results: files or folders; () with `acceptance`
    budgets: tuple[int, ...] = (4, 8, 16, 32)  # node budgets
    batches: tuple[int, ...] = ()  # () : the run's batch sizes
    by_depth: bool = False  # acceptance per depth and rank, not pooled over depths per rank
    draft_cost: float | None = None  # c per draft level; None: measured by the run against its baseline
    target: str | None = None  # the model to profile; None: the run's target
    context: int | None = None  # None: the run's mean prompt plus half its mean new tokens
    device: str = "auto"
    dtype: str | None = None  # None: the run's
    fast: bool = True
    strategy: str | None = None  # only this strategy's (or preset's) rows: a run with --compare holds several
    acceptance: str | None = None  # a shipped acceptance table (analysis/tree_acceptance.py) instead of results


@dataclass(frozen=True)
class PredictChainConfig:
    """`sdbench predict chain`: insert `candidate` into a polybasic chain under level `at`; predict, then measure."""

    target: str
    drafts: tuple[str, ...]  # the chain as it is, top down (ngram allowed last)
    candidate: str
    at: int  # 0: under the target; i: under the i-th draft
    gamma: int  # the bottom drafter's tokens per block
    mu: str  # the middle levels' thresholds ("": the default)
    dataset: str
    limit: int
    max_new_tokens: int
    profile_prompts: int
    profile_tokens: int
    device: str
    dtype: str
    seed: int
    temperature: float  # the profiling pass again under sampling at it; 0: greedy only


@dataclass(frozen=True)
class SimulateDSIConfig:
    """`sdbench simulate dsi`: one setting given, measured at models' shapes (`target`) or read from a run
    (`from_results`), simulated; then the heat-map grid."""

    target_latency: float  # one target forward (seconds; 1 = count forwards)
    c: float  # one draft forward / one target forward
    a: float | None  # acceptance rate; None: 0.8, or with `from_results` the run's
    k: int
    workers: int
    tokens: int
    repeats: int  # simulated generations averaged online
    grid: int
    kmax: int
    seed: int
    from_results: tuple[str, ...]  # an sdbench run to take the setting from
    target: str | None  # measure the target latency and c at this model's shape
    draft: str | None  # with target: the drafter (None: the target)
    context: int  # with target: the prompt length the latencies are measured at
    device: str
    dtype: str
    out: str  # folder for dsi-heatmap.parquet and .png
