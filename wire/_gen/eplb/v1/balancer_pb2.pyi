import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_INT32: _ClassVar[Dtype]
    DTYPE_INT64: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT64: _ClassVar[Dtype]

class AckState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_STATE_UNSPECIFIED: _ClassVar[AckState]
    ACK_STATE_PREPARED: _ClassVar[AckState]
    ACK_STATE_SWITCHED: _ClassVar[AckState]
    ACK_STATE_FAILED: _ClassVar[AckState]
DTYPE_UNSPECIFIED: Dtype
DTYPE_INT32: Dtype
DTYPE_INT64: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT64: Dtype
ACK_STATE_UNSPECIFIED: AckState
ACK_STATE_PREPARED: AckState
ACK_STATE_SWITCHED: AckState
ACK_STATE_FAILED: AckState

class Array(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("num_layers", "num_experts", "num_slots", "num_gpus", "num_nodes", "num_groups")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_experts: int
    num_slots: int
    num_gpus: int
    num_nodes: int
    num_groups: int
    def __init__(self, num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., num_slots: _Optional[int] = ..., num_gpus: _Optional[int] = ..., num_nodes: _Optional[int] = ..., num_groups: _Optional[int] = ...) -> None: ...

class SlidingWindow(_message.Message):
    __slots__ = ("duration", "report_count", "buckets")
    DURATION_FIELD_NUMBER: _ClassVar[int]
    REPORT_COUNT_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    duration: _duration_pb2.Duration
    report_count: int
    buckets: int
    def __init__(self, duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., report_count: _Optional[int] = ..., buckets: _Optional[int] = ...) -> None: ...

class DecayWindow(_message.Message):
    __slots__ = ("half_life",)
    HALF_LIFE_FIELD_NUMBER: _ClassVar[int]
    half_life: _duration_pb2.Duration
    def __init__(self, half_life: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Window(_message.Message):
    __slots__ = ("sliding", "decay")
    SLIDING_FIELD_NUMBER: _ClassVar[int]
    DECAY_FIELD_NUMBER: _ClassVar[int]
    sliding: SlidingWindow
    decay: DecayWindow
    def __init__(self, sliding: _Optional[_Union[SlidingWindow, _Mapping]] = ..., decay: _Optional[_Union[DecayWindow, _Mapping]] = ...) -> None: ...

class Trigger(_message.Message):
    __slots__ = ("interval", "report_count", "min_gain_percent", "max_moves", "max_payback_steps")
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    REPORT_COUNT_FIELD_NUMBER: _ClassVar[int]
    MIN_GAIN_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MAX_MOVES_FIELD_NUMBER: _ClassVar[int]
    MAX_PAYBACK_STEPS_FIELD_NUMBER: _ClassVar[int]
    interval: _duration_pb2.Duration
    report_count: int
    min_gain_percent: float
    max_moves: int
    max_payback_steps: int
    def __init__(self, interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., report_count: _Optional[int] = ..., min_gain_percent: _Optional[float] = ..., max_moves: _Optional[int] = ..., max_payback_steps: _Optional[int] = ...) -> None: ...

class Deployment(_message.Message):
    __slots__ = ("name", "topology", "policy", "window", "trigger", "create_time", "version", "migration", "ranks", "switch_margin_steps", "planning", "expert_bytes", "liveness")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SWITCH_MARGIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLANNING_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    topology: Topology
    policy: str
    window: Window
    trigger: Trigger
    create_time: _timestamp_pb2.Timestamp
    version: int
    migration: Migration
    ranks: _containers.RepeatedScalarFieldContainer[int]
    switch_margin_steps: int
    planning: Planning
    expert_bytes: int
    liveness: Liveness
    def __init__(self, name: _Optional[str] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ..., policy: _Optional[str] = ..., window: _Optional[_Union[Window, _Mapping]] = ..., trigger: _Optional[_Union[Trigger, _Mapping]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., version: _Optional[int] = ..., migration: _Optional[_Union[Migration, _Mapping]] = ..., ranks: _Optional[_Iterable[int]] = ..., switch_margin_steps: _Optional[int] = ..., planning: _Optional[_Union[Planning, _Mapping]] = ..., expert_bytes: _Optional[int] = ..., liveness: _Optional[_Union[Liveness, _Mapping]] = ...) -> None: ...

class Liveness(_message.Message):
    __slots__ = ("suspect_after",)
    SUSPECT_AFTER_FIELD_NUMBER: _ClassVar[int]
    suspect_after: _duration_pb2.Duration
    def __init__(self, suspect_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Planning(_message.Message):
    __slots__ = ("effort", "work_budget", "time_limit", "kernel_model", "tokens_per_gpu", "top_k", "dispatch")
    EFFORT_FIELD_NUMBER: _ClassVar[int]
    WORK_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_FIELD_NUMBER: _ClassVar[int]
    KERNEL_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_FIELD_NUMBER: _ClassVar[int]
    effort: str
    work_budget: int
    time_limit: _duration_pb2.Duration
    kernel_model: str
    tokens_per_gpu: _containers.RepeatedScalarFieldContainer[int]
    top_k: int
    dispatch: str
    def __init__(self, effort: _Optional[str] = ..., work_budget: _Optional[int] = ..., time_limit: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., kernel_model: _Optional[str] = ..., tokens_per_gpu: _Optional[_Iterable[int]] = ..., top_k: _Optional[int] = ..., dispatch: _Optional[str] = ...) -> None: ...

class Migration(_message.Message):
    __slots__ = ("tolerance", "layer_tolerance", "max_moves", "max_layer_moves")
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    LAYER_TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    MAX_MOVES_FIELD_NUMBER: _ClassVar[int]
    MAX_LAYER_MOVES_FIELD_NUMBER: _ClassVar[int]
    tolerance: float
    layer_tolerance: float
    max_moves: int
    max_layer_moves: int
    def __init__(self, tolerance: _Optional[float] = ..., layer_tolerance: _Optional[float] = ..., max_moves: _Optional[int] = ..., max_layer_moves: _Optional[int] = ...) -> None: ...

class PlanStats(_message.Message):
    __slots__ = ("policy", "policy_used", "imbalance_before", "imbalance_after", "imbalance_lb", "max_imbalance_after", "moves", "solve_seconds", "gain_percent", "notes", "budget_limited", "transfer", "predicted_ms", "predicted_ms_before", "predicted_saved_ms", "predicted_gain_percent")
    class PredictedMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class PredictedMsBeforeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_USED_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_AFTER_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_LB_FIELD_NUMBER: _ClassVar[int]
    MAX_IMBALANCE_AFTER_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    SOLVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GAIN_PERCENT_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_LIMITED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SAVED_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GAIN_PERCENT_FIELD_NUMBER: _ClassVar[int]
    policy: str
    policy_used: str
    imbalance_before: float
    imbalance_after: float
    imbalance_lb: float
    max_imbalance_after: float
    moves: int
    solve_seconds: float
    gain_percent: float
    notes: _containers.RepeatedScalarFieldContainer[str]
    budget_limited: bool
    transfer: TransferStats
    predicted_ms: _containers.ScalarMap[int, float]
    predicted_ms_before: _containers.ScalarMap[int, float]
    predicted_saved_ms: float
    predicted_gain_percent: float
    def __init__(self, policy: _Optional[str] = ..., policy_used: _Optional[str] = ..., imbalance_before: _Optional[float] = ..., imbalance_after: _Optional[float] = ..., imbalance_lb: _Optional[float] = ..., max_imbalance_after: _Optional[float] = ..., moves: _Optional[int] = ..., solve_seconds: _Optional[float] = ..., gain_percent: _Optional[float] = ..., notes: _Optional[_Iterable[str]] = ..., budget_limited: _Optional[bool] = ..., transfer: _Optional[_Union[TransferStats, _Mapping]] = ..., predicted_ms: _Optional[_Mapping[int, float]] = ..., predicted_ms_before: _Optional[_Mapping[int, float]] = ..., predicted_saved_ms: _Optional[float] = ..., predicted_gain_percent: _Optional[float] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("bytes", "cross_node_bytes", "rounds", "max_rank_round_bytes", "predicted_seconds", "restored_experts", "restored_bytes")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CROSS_NODE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_ROUND_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    cross_node_bytes: int
    rounds: int
    max_rank_round_bytes: int
    predicted_seconds: float
    restored_experts: int
    restored_bytes: int
    def __init__(self, bytes: _Optional[int] = ..., cross_node_bytes: _Optional[int] = ..., rounds: _Optional[int] = ..., max_rank_round_bytes: _Optional[int] = ..., predicted_seconds: _Optional[float] = ..., restored_experts: _Optional[int] = ..., restored_bytes: _Optional[int] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("deployment", "version", "phy2log", "stats", "create_time", "down_ranks", "down_ranks_version", "survivor_of", "loads", "eplb_version")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    DOWN_RANKS_FIELD_NUMBER: _ClassVar[int]
    DOWN_RANKS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SURVIVOR_OF_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    EPLB_VERSION_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    version: int
    phy2log: Array
    stats: PlanStats
    create_time: _timestamp_pb2.Timestamp
    down_ranks: _containers.RepeatedScalarFieldContainer[int]
    down_ranks_version: int
    survivor_of: int
    loads: Array
    eplb_version: str
    def __init__(self, deployment: _Optional[str] = ..., version: _Optional[int] = ..., phy2log: _Optional[_Union[Array, _Mapping]] = ..., stats: _Optional[_Union[PlanStats, _Mapping]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., down_ranks: _Optional[_Iterable[int]] = ..., down_ranks_version: _Optional[int] = ..., survivor_of: _Optional[int] = ..., loads: _Optional[_Union[Array, _Mapping]] = ..., eplb_version: _Optional[str] = ...) -> None: ...

class CreateDeploymentRequest(_message.Message):
    __slots__ = ("deployment", "initial_phy2log")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    INITIAL_PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    deployment: Deployment
    initial_phy2log: Array
    def __init__(self, deployment: _Optional[_Union[Deployment, _Mapping]] = ..., initial_phy2log: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class CreateDeploymentResponse(_message.Message):
    __slots__ = ("deployment", "placement")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    deployment: Deployment
    placement: Placement
    def __init__(self, deployment: _Optional[_Union[Deployment, _Mapping]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class GetDeploymentRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RankAck(_message.Message):
    __slots__ = ("rank", "version", "prepared_version", "failed_version")
    RANK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREPARED_VERSION_FIELD_NUMBER: _ClassVar[int]
    FAILED_VERSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    version: int
    prepared_version: int
    failed_version: int
    def __init__(self, rank: _Optional[int] = ..., version: _Optional[int] = ..., prepared_version: _Optional[int] = ..., failed_version: _Optional[int] = ...) -> None: ...

class SuspectRank(_message.Message):
    __slots__ = ("rank", "seconds_since_seen", "ever_seen")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_SEEN_FIELD_NUMBER: _ClassVar[int]
    EVER_SEEN_FIELD_NUMBER: _ClassVar[int]
    rank: int
    seconds_since_seen: float
    ever_seen: bool
    def __init__(self, rank: _Optional[int] = ..., seconds_since_seen: _Optional[float] = ..., ever_seen: _Optional[bool] = ...) -> None: ...

class GetDeploymentResponse(_message.Message):
    __slots__ = ("deployment", "acks", "down_ranks", "status")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    DOWN_RANKS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    deployment: Deployment
    acks: _containers.RepeatedCompositeFieldContainer[RankAck]
    down_ranks: _containers.RepeatedScalarFieldContainer[int]
    status: DeploymentStatus
    def __init__(self, deployment: _Optional[_Union[Deployment, _Mapping]] = ..., acks: _Optional[_Iterable[_Union[RankAck, _Mapping]]] = ..., down_ranks: _Optional[_Iterable[int]] = ..., status: _Optional[_Union[DeploymentStatus, _Mapping]] = ...) -> None: ...

class DeploymentStatus(_message.Message):
    __slots__ = ("version", "version_time", "ranks_acked", "ranks_prepared", "ranks_failed", "num_ranks", "last_plan_time", "stats", "suspect_ranks")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_TIME_FIELD_NUMBER: _ClassVar[int]
    RANKS_ACKED_FIELD_NUMBER: _ClassVar[int]
    RANKS_PREPARED_FIELD_NUMBER: _ClassVar[int]
    RANKS_FAILED_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    LAST_PLAN_TIME_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_RANKS_FIELD_NUMBER: _ClassVar[int]
    version: int
    version_time: _timestamp_pb2.Timestamp
    ranks_acked: int
    ranks_prepared: int
    ranks_failed: int
    num_ranks: int
    last_plan_time: _timestamp_pb2.Timestamp
    stats: PlanStats
    suspect_ranks: _containers.RepeatedCompositeFieldContainer[SuspectRank]
    def __init__(self, version: _Optional[int] = ..., version_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ranks_acked: _Optional[int] = ..., ranks_prepared: _Optional[int] = ..., ranks_failed: _Optional[int] = ..., num_ranks: _Optional[int] = ..., last_plan_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., stats: _Optional[_Union[PlanStats, _Mapping]] = ..., suspect_ranks: _Optional[_Iterable[_Union[SuspectRank, _Mapping]]] = ...) -> None: ...

class ListDeploymentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDeploymentsResponse(_message.Message):
    __slots__ = ("deployments", "statuses")
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    deployments: _containers.RepeatedCompositeFieldContainer[Deployment]
    statuses: _containers.RepeatedCompositeFieldContainer[DeploymentStatus]
    def __init__(self, deployments: _Optional[_Iterable[_Union[Deployment, _Mapping]]] = ..., statuses: _Optional[_Iterable[_Union[DeploymentStatus, _Mapping]]] = ...) -> None: ...

class DeleteDeploymentRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteDeploymentResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PhysicalCounts(_message.Message):
    __slots__ = ("counts", "placement_version")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    counts: Array
    placement_version: int
    def __init__(self, counts: _Optional[_Union[Array, _Mapping]] = ..., placement_version: _Optional[int] = ...) -> None: ...

class ReportLoadRequest(_message.Message):
    __slots__ = ("deployment", "rank", "seq", "logical", "physical", "steps", "covers")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    COVERS_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    rank: int
    seq: int
    logical: Array
    physical: PhysicalCounts
    steps: int
    covers: _containers.RepeatedCompositeFieldContainer[ReportCover]
    def __init__(self, deployment: _Optional[str] = ..., rank: _Optional[int] = ..., seq: _Optional[int] = ..., logical: _Optional[_Union[Array, _Mapping]] = ..., physical: _Optional[_Union[PhysicalCounts, _Mapping]] = ..., steps: _Optional[int] = ..., covers: _Optional[_Iterable[_Union[ReportCover, _Mapping]]] = ...) -> None: ...

class ReportCover(_message.Message):
    __slots__ = ("rank", "seq")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    rank: int
    seq: int
    def __init__(self, rank: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class ReportLoadResponse(_message.Message):
    __slots__ = ("accepted", "duplicates")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class ReportLoadAck(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ("deployment", "version", "include_window_loads")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_WINDOW_LOADS_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    version: int
    include_window_loads: bool
    def __init__(self, deployment: _Optional[str] = ..., version: _Optional[int] = ..., include_window_loads: _Optional[bool] = ...) -> None: ...

class GetPlacementResponse(_message.Message):
    __slots__ = ("placement", "window_loads", "window_reports")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_LOADS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_REPORTS_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    window_loads: Array
    window_reports: int
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ..., window_loads: _Optional[_Union[Array, _Mapping]] = ..., window_reports: _Optional[int] = ...) -> None: ...

class WatchPlacementsRequest(_message.Message):
    __slots__ = ("deployment", "since_version", "max_part_bytes")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_PART_BYTES_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    since_version: int
    max_part_bytes: int
    def __init__(self, deployment: _Optional[str] = ..., since_version: _Optional[int] = ..., max_part_bytes: _Optional[int] = ...) -> None: ...

class WatchPlacementsResponse(_message.Message):
    __slots__ = ("placement", "part")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    part: PlacementPart
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ..., part: _Optional[_Union[PlacementPart, _Mapping]] = ...) -> None: ...

class PlacementPart(_message.Message):
    __slots__ = ("version", "index", "count", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    index: int
    count: int
    data: bytes
    def __init__(self, version: _Optional[int] = ..., index: _Optional[int] = ..., count: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class AckPlacementRequest(_message.Message):
    __slots__ = ("deployment", "rank", "version", "state", "step", "error")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    rank: int
    version: int
    state: AckState
    step: int
    error: str
    def __init__(self, deployment: _Optional[str] = ..., rank: _Optional[int] = ..., version: _Optional[int] = ..., state: _Optional[_Union[AckState, str]] = ..., step: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class AckPlacementResponse(_message.Message):
    __slots__ = ("ranks_acked", "ranks_prepared", "ranks_failed", "num_ranks", "switch_step", "aborted")
    RANKS_ACKED_FIELD_NUMBER: _ClassVar[int]
    RANKS_PREPARED_FIELD_NUMBER: _ClassVar[int]
    RANKS_FAILED_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    SWITCH_STEP_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    ranks_acked: int
    ranks_prepared: int
    ranks_failed: int
    num_ranks: int
    switch_step: int
    aborted: bool
    def __init__(self, ranks_acked: _Optional[int] = ..., ranks_prepared: _Optional[int] = ..., ranks_failed: _Optional[int] = ..., num_ranks: _Optional[int] = ..., switch_step: _Optional[int] = ..., aborted: _Optional[bool] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("deployment", "dry_run", "force")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    dry_run: bool
    force: bool
    def __init__(self, deployment: _Optional[str] = ..., dry_run: _Optional[bool] = ..., force: _Optional[bool] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("published", "placement", "reason", "window_tokens", "window_reports")
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_REPORTS_FIELD_NUMBER: _ClassVar[int]
    published: bool
    placement: Placement
    reason: str
    window_tokens: float
    window_reports: int
    def __init__(self, published: _Optional[bool] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., reason: _Optional[str] = ..., window_tokens: _Optional[float] = ..., window_reports: _Optional[int] = ...) -> None: ...

class ComputePlacementRequest(_message.Message):
    __slots__ = ("topology", "policy", "loads", "previous_phy2log", "migration", "planning", "expert_bytes")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    PLANNING_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    topology: Topology
    policy: str
    loads: Array
    previous_phy2log: Array
    migration: Migration
    planning: Planning
    expert_bytes: int
    def __init__(self, topology: _Optional[_Union[Topology, _Mapping]] = ..., policy: _Optional[str] = ..., loads: _Optional[_Union[Array, _Mapping]] = ..., previous_phy2log: _Optional[_Union[Array, _Mapping]] = ..., migration: _Optional[_Union[Migration, _Mapping]] = ..., planning: _Optional[_Union[Planning, _Mapping]] = ..., expert_bytes: _Optional[int] = ...) -> None: ...

class SetRanksDownRequest(_message.Message):
    __slots__ = ("deployment", "down", "up", "reason")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    DOWN_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    down: _containers.RepeatedScalarFieldContainer[int]
    up: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, deployment: _Optional[str] = ..., down: _Optional[_Iterable[int]] = ..., up: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class SetRanksDownResponse(_message.Message):
    __slots__ = ("down_ranks", "published", "placement")
    DOWN_RANKS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    down_ranks: _containers.RepeatedScalarFieldContainer[int]
    published: bool
    placement: Placement
    def __init__(self, down_ranks: _Optional[_Iterable[int]] = ..., published: _Optional[bool] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class ComputePlacementResponse(_message.Message):
    __slots__ = ("phy2log", "logcnt", "stats")
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    LOGCNT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    phy2log: Array
    logcnt: Array
    stats: PlanStats
    def __init__(self, phy2log: _Optional[_Union[Array, _Mapping]] = ..., logcnt: _Optional[_Union[Array, _Mapping]] = ..., stats: _Optional[_Union[PlanStats, _Mapping]] = ...) -> None: ...
