"""The triage runbook as code: what a server's metrics (and a few probe requests) say is wrong.

`pagoda doctor` (ops/, over HTTP) and the dashboard's diagnosis panel (serve/, from its own
registry) both read two samples of the Prometheus families a window apart, turn them into
`Observations` and run the same `diagnose` over them; only how the samples are obtained
differs. It sits in the bottom layer so that serve/ and ops/ can both import it; it imports
nothing of pagoda but `stats`.
"""

from pagoda.diagnosis.findings import SEVERITIES, Finding, Severity, worst_severity
from pagoda.diagnosis.observations import MetricSamples, Observations, ProbeReadings, observe
from pagoda.diagnosis.rules import Targets, diagnose

__all__ = [
    "SEVERITIES",
    "Finding",
    "MetricSamples",
    "Observations",
    "ProbeReadings",
    "Severity",
    "Targets",
    "diagnose",
    "observe",
    "worst_severity",
]
