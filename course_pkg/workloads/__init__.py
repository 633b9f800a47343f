"""Workloads for the experiments: request generators (``requests``) and the harness that
serves them with the real Scheduler and a fake model (``harness``)."""
from course_pkg.workloads.harness import SimResult, WorkloadRun, simulate
from course_pkg.workloads.requests import (VOCAB_SIZE, Request, multi_turn_workload, random_workload,
                                           shared_prefix_workload)

__all__ = ["VOCAB_SIZE", "Request", "SimResult", "WorkloadRun", "multi_turn_workload", "random_workload",
           "shared_prefix_workload", "simulate"]
