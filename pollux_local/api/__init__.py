"""The contract between the parts of pollux-local: what crosses a process boundary.

Everything here is typed and validated strictly, and imported by every side: the daemon, the
client, the CLI, the TUI and the job library.  It depends on nothing else of the project.

* :mod:`~pollux_local.api.messages`: one request type per command and its reply;
* :mod:`~pollux_local.api.wire`: framing and strict (de)coding;
* :mod:`~pollux_local.api.states`: :class:`JobState` (its docstring is the state machine) and
  :class:`ExitCode`;
* :mod:`~pollux_local.api.spec`: :class:`JobSpec`, a job as the daemon stores it;
* :mod:`~pollux_local.api.exits`: how a job's replicas ended (:class:`ReplicaExit`);
* :mod:`~pollux_local.api.launch`: the launch environment a replica gets;
* :mod:`~pollux_local.api.report`: the job report a job sends;
* :mod:`~pollux_local.api.errors`: the exception tree.
"""

from pollux_local.api.errors import (
    Conflict,
    DaemonUnavailable,
    InternalError,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    PolluxError,
    ProtocolError,
)
from pollux_local.api.exits import ReplicaExit
from pollux_local.api.launch import LaunchEnvironment
from pollux_local.api.messages import (
    PROTOCOL_VERSION,
    REQUEST_TYPES,
    ArrayTask,
    Cancel,
    CancelReply,
    DecisionRecord,
    DeviceUsage,
    Drain,
    DrainReply,
    Edit,
    Estimate,
    EstimateReply,
    Hold,
    JobDetail,
    JobForecast,
    JobStateReply,
    JobSummary,
    Logs,
    LogsReply,
    Nodes,
    NodesReply,
    Ping,
    PingReply,
    PriorityReply,
    Release,
    Reply,
    Report,
    ReportReply,
    Request,
    Restart,
    Resume,
    SetPriority,
    Show,
    ShowReply,
    StateChangeReply,
    Status,
    StatusReply,
    Submit,
    SubmitReply,
    Usage,
    UsageReply,
)
from pollux_local.api.report import REPORT_VERSION, JobReport
from pollux_local.api.spec import Constraint, JobSpec, Target, decode_spec
from pollux_local.api.states import ACTIVE_STATES, TERMINAL_STATES, ExitCode, JobState

__all__ = [
    "ACTIVE_STATES",
    "PROTOCOL_VERSION",
    "REPORT_VERSION",
    "REQUEST_TYPES",
    "TERMINAL_STATES",
    "ArrayTask",
    "Cancel",
    "CancelReply",
    "Conflict",
    "Constraint",
    "DaemonUnavailable",
    "DecisionRecord",
    "DeviceUsage",
    "Drain",
    "DrainReply",
    "Edit",
    "Estimate",
    "EstimateReply",
    "ExitCode",
    "Hold",
    "InternalError",
    "InvalidRequest",
    "JobDetail",
    "JobForecast",
    "JobReport",
    "JobSpec",
    "JobState",
    "JobStateReply",
    "JobSummary",
    "LaunchEnvironment",
    "LimitExceeded",
    "Logs",
    "LogsReply",
    "Nodes",
    "NodesReply",
    "NotFound",
    "PermissionDenied",
    "Ping",
    "PingReply",
    "PolluxError",
    "PriorityReply",
    "ProtocolError",
    "Release",
    "ReplicaExit",
    "Reply",
    "Report",
    "ReportReply",
    "Request",
    "Restart",
    "Resume",
    "SetPriority",
    "Show",
    "ShowReply",
    "StateChangeReply",
    "Status",
    "StatusReply",
    "Submit",
    "SubmitReply",
    "Target",
    "Usage",
    "UsageReply",
    "decode_spec",
]
