"""Agents: the ``Agent`` base (update_from_env -> update_from_model -> step), the registry, code agents."""

from pettingflow.agents.base import (
    Agent,
    AgentPrompt,
    build_agent,
    chat_token_ids,
    register_agent,
    registered_agents,
    resolve_agent_class,
)
from pettingflow.agents.code_agents import CodeGeneratorAgent, UnitTestGeneratorAgent, extract_asserts, extract_code

__all__ = [
    "Agent",
    "AgentPrompt",
    "CodeGeneratorAgent",
    "UnitTestGeneratorAgent",
    "build_agent",
    "chat_token_ids",
    "extract_asserts",
    "extract_code",
    "register_agent",
    "registered_agents",
    "resolve_agent_class",
]
