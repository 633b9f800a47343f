"""The engine (chapter 06): ModelRunner (KV tensor, slot mappings), Sampler, LLMEngine, LLM."""
from course_pkg.engine.llm import LLM
from course_pkg.engine.config import EngineConfig
from course_pkg.engine.llm_engine import LLMEngine
from course_pkg.engine.model_runner import ModelRunner
from course_pkg.engine.outputs import (CompletionOutput, EngineMetrics, ModelRunnerOutput, RequestMetrics,
                                       RequestOutput, StepInfo)
from course_pkg.engine.sampler import Sampler

__all__ = ["LLM", "LLMEngine", "EngineConfig", "CompletionOutput", "EngineMetrics", "ModelRunnerOutput",
           "RequestMetrics", "RequestOutput", "StepInfo", "ModelRunner", "Sampler"]
