"""Agents: parsing, prompts, env-mediated communication, turn order, rewards, layouts, registry."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_code_env import BUGGY_CODE, GOOD_CODE, TOY_TASK, FakeSandbox, toy_env

from pettingflow.agents.base import (
    Agent,
    AgentPrompt,
    build_agent,
    chat_token_ids,
    register_agent,
    registered_agents,
    resolve_agent_class,
)
from pettingflow.agents.code_agents import (
    CodeGeneratorAgent,
    UnitTestGeneratorAgent,
    complete_solution,
    extract_asserts,
    extract_code,
)
from pettingflow.configs.settings import AgentSettings, SamplingSettings
from pettingflow.envs.base import Env
from pettingflow.envs.code_env import CodeEnv
from pettingflow.envs.registry import RegistryError


class FakeTokenizer:
    """Deterministic chat template: one token per character of ``<role>content</role>...``."""

    def render(self, conversation: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in conversation)
        return text + ("<assistant>" if add_generation_prompt else "")

    def apply_chat_template(
        self, conversation: list[dict[str, str]], *, add_generation_prompt: bool = False, tokenize: bool = True
    ) -> Any:
        text = self.render(conversation, add_generation_prompt)
        return [ord(c) for c in text] if tokenize else text


class DictTokenizer(FakeTokenizer):
    """transformers 5 style: a mapping with batched ``input_ids``."""

    def apply_chat_template(self, conversation: Any, **kw: Any) -> Any:
        return {"input_ids": [super().apply_chat_template(conversation, **kw)], "attention_mask": [[1]]}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def decode(prompt: AgentPrompt) -> str:
    return "".join(chr(t) for t in prompt.token_ids)


async def take_turn(agent: Agent, env: Env, response: str) -> AgentPrompt:
    """What the execution engine does for one agent call."""
    prompt = agent.update_from_env(env.current_turn, env)
    agent.update_from_model(env.current_turn, env, response)
    await agent.step(env)
    return prompt


def py(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```\nDone."


# --------------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------------
def test_extract_code_takes_last_python_block() -> None:
    text = "```python\nx = 1\n```\ntext\n```py\ndef f():\n    return 2\n```\n```\nplain\n```"
    assert extract_code(text) == "def f():\n    return 2"


def test_extract_code_falls_back_to_any_block_and_unclosed_fence() -> None:
    assert extract_code("```\ndef f(): pass\n```") == "def f(): pass"
    assert extract_code("Sure!\n```python\ndef f():\n    return 1\n") == "def f():\n    return 1"


def test_extract_code_without_fences() -> None:
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1"
    prose = "Here is my answer.\ndef f():\n    return 1\nThis returns one."
    assert extract_code(prose) == "def f():\n    return 1"
    assert extract_code("no code at all") == "no code at all"
    assert extract_code("") == ""


def test_complete_solution_prepends_prompt_to_a_bare_body() -> None:
    prompt = TOY_TASK["prompt"]
    assert complete_solution("    return a + b", prompt, "add") == prompt + "    return a + b"
    assert complete_solution(GOOD_CODE, prompt, "add") == GOOD_CODE
    assert complete_solution("return a +", prompt, "add") == "return a +"  # not fixable: left as is


def test_extract_asserts_filters_and_dedupes() -> None:
    text = (
        "```python\nassert add(1, 2) == 3\nassert True\nassert add(1,2)==3\n"
        "def test_it():\n    assert add(0, 0) == 0\nassert other(1) == 1\n```"
    )
    assert extract_asserts(text, "add") == ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]


def test_extract_asserts_reads_unparsable_blocks_line_by_line() -> None:
    text = "```python\nassert add(1, 2) == 3\nassert add(2, 2) == \nthis is not python\n  assert add(5, 5) == 10\n"
    assert extract_asserts(text, "add") == ["assert add(1, 2) == 3", "assert add(5, 5) == 10"]
    assert extract_asserts("assert add(1, 1) == 2", "add") == ["assert add(1, 1) == 2"]
    assert extract_asserts("I cannot write tests.", "add") == []


# --------------------------------------------------------------------------------------------------
# tokenizer output shapes
# --------------------------------------------------------------------------------------------------
def test_chat_token_ids_accepts_list_and_dict() -> None:
    messages = [{"role": "user", "content": "hi"}]
    expected = [ord(c) for c in "<user>hi</user><assistant>"]
    assert chat_token_ids(FakeTokenizer(), messages) == expected
    assert chat_token_ids(DictTokenizer(), messages) == expected


def test_chat_token_ids_with_a_real_transformers_tokenizer() -> None:
    """transformers 5 returns a BatchEncoding by default; built in memory, nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate([chr(i) for i in range(32, 127)] + ["\n", "[UNK]"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    ids = chat_token_ids(tok, [{"role": "user", "content": "hi"}])
    assert ids == [vocab[c] for c in "<|user|>hi\n<|assistant|>"]


def test_chat_token_ids_rejects_text() -> None:
    class Text:
        def apply_chat_template(self, conversation: Any, **kw: Any) -> Any:
            return "not tokens"

    with pytest.raises(TypeError, match="expected token ids"):
        chat_token_ids(Text(), [{"role": "user", "content": "x"}])


# --------------------------------------------------------------------------------------------------
# prompts and env-mediated communication
# --------------------------------------------------------------------------------------------------
def test_code_agent_first_prompt_shows_problem_only() -> None:
    env = toy_env()
    agent = CodeGeneratorAgent(tokenizer=FakeTokenizer())
    prompt = agent.update_from_env(0, env)
    assert [m["role"] for m in prompt.messages] == ["system", "user"]
    user = prompt.messages[1]["content"]
    assert TOY_TASK["prompt"].strip() in user and "`add`" in user and "```python" in user
    assert "return a + b" not in user and "candidate(" not in user  # no canonical solution, no hidden tests
    assert decode(prompt) == FakeTokenizer().render(prompt.messages, True)
    assert agent.current_prompt is prompt


def test_test_agent_sees_code_written_by_code_agent_through_env_state() -> None:
    env = toy_env()
    coder = CodeGeneratorAgent(tokenizer=FakeTokenizer(), agent_idx=0)
    tester = UnitTestGeneratorAgent(tokenizer=FakeTokenizer(), agent_idx=1)
    run(take_turn(coder, env, py(BUGGY_CODE)))
    assert env.state.generated_code == BUGGY_CODE
    prompt = tester.update_from_env(1, env)
    assert BUGGY_CODE in prompt.messages[-1]["content"]
    assert "assert add(" in prompt.messages[-1]["content"]


def test_code_agent_sees_failing_generated_tests_next_turn() -> None:
    env = toy_env()
    coder = CodeGeneratorAgent(tokenizer=FakeTokenizer())
    tester = UnitTestGeneratorAgent(tokenizer=FakeTokenizer(), agent_idx=1)
    run(take_turn(coder, env, py(BUGGY_CODE)))
    run(take_turn(tester, env, py("assert add(2, 3) == 5\nassert add(0, 0) == 0")))
    user = coder.update_from_env(2, env).messages[-1]["content"]
    assert BUGGY_CODE in user and "It fails these tests" in user
    assert "`assert add(2, 3) == 5`" in user and "assert add(0, 0) == 0" not in user


# --------------------------------------------------------------------------------------------------
# full episodes: turn order, rewards, termination
# --------------------------------------------------------------------------------------------------
def test_episode_code_test_code_until_success() -> None:
    sandbox = FakeSandbox()
    env = toy_env(max_turns=6, sandbox=sandbox)
    coder = CodeGeneratorAgent(tokenizer=FakeTokenizer(), agent_idx=0, policy_name="shared")
    tester = UnitTestGeneratorAgent(tokenizer=FakeTokenizer(), agent_idx=1, policy_name="shared")
    order = [coder, tester]
    replies = {
        0: py(BUGGY_CODE),
        1: py("assert add(2, 3) == 5\nassert add(1, 1) == 3\nassert add(0, 0) == 0"),
        2: py(GOOD_CODE),
    }
    acted = []
    while not env.done:
        agent = order[env.current_turn % len(order)]
        acted.append(agent.name)
        run(take_turn(agent, env, replies[env.current_turn]))
    assert acted == ["code_generator", "test_generator", "code_generator"]
    assert env.done and not env.truncated and env.current_turn == 3
    assert coder.reward_history == pytest.approx([1 / 3, 1.0]) and coder.success
    # tests: 2 of 3 valid, one valid test fails the buggy code -> 0.5 * 2/3 + 0.5
    assert tester.reward_history == pytest.approx([0.5 * 2 / 3 + 0.5]) and not tester.success
    assert tester.last_reward_parts is not None and tester.last_reward_parts.caught == 1
    assert [h["agent_name"] for h in env.history] == acted
    assert len(sandbox.programs) == 3  # one sandbox call per agent turn
    assert coder.answer_history[0] == replies[0] and coder.action_history == [BUGGY_CODE, GOOD_CODE]


def test_episode_stops_at_max_turns() -> None:
    env = toy_env(max_turns=2)
    coder = CodeGeneratorAgent(tokenizer=FakeTokenizer())
    tester = UnitTestGeneratorAgent(tokenizer=FakeTokenizer(), agent_idx=1)
    run(take_turn(coder, env, py(BUGGY_CODE)))
    run(take_turn(tester, env, py("assert add(0, 0) == 0")))
    assert env.done and env.truncated
    assert tester.success and tester.agent_reward == pytest.approx(0.5)  # valid, but catches nothing
    with pytest.raises(RuntimeError, match="already over"):
        coder.update_from_env(2, env)


def test_success_on_first_turn_ends_before_tester_acts() -> None:
    env = toy_env(max_turns=4)
    coder = CodeGeneratorAgent(tokenizer=FakeTokenizer())
    run(take_turn(coder, env, py(GOOD_CODE)))
    assert env.done and coder.success and coder.agent_reward == 1.0


def test_garbage_reply_gets_zero_not_a_crash() -> None:
    env = toy_env()
    coder = CodeGeneratorAgent(tokenizer=FakeTokenizer())
    tester = UnitTestGeneratorAgent(tokenizer=FakeTokenizer(), agent_idx=1)
    run(take_turn(coder, env, "I don't know."))
    assert coder.agent_reward == 0.0 and not coder.success
    run(take_turn(tester, env, "No tests today."))
    assert tester.agent_reward == 0.0 and tester.current_action == []


def test_test_agent_going_first_is_scored_on_validity() -> None:
    env = toy_env()
    tester = UnitTestGeneratorAgent(tokenizer=FakeTokenizer())
    prompt = run(take_turn(tester, env, py("assert add(2, 3) == 5\nassert add(2, 2) == 5")))
    assert "Someone wrote this code" not in prompt.messages[-1]["content"]
    assert tester.agent_reward == pytest.approx(0.5)


def test_call_order_is_enforced() -> None:
    env = toy_env()
    coder = CodeGeneratorAgent(tokenizer=FakeTokenizer())
    with pytest.raises(RuntimeError, match="update_from_env must come before"):
        coder.update_from_model(0, env, "x")
    with pytest.raises(ValueError, match="called for turn 1, but the env is at 0"):
        coder.update_from_env(1, env)
    coder.update_from_env(0, env)
    with pytest.raises(RuntimeError, match="needs an action"):
        run(coder.step(env))
    with pytest.raises(RuntimeError, match="no tokenizer"):
        CodeGeneratorAgent().update_from_env(0, env)


def test_reset_clears_episode_data() -> None:
    env = toy_env()
    coder = CodeGeneratorAgent(tokenizer=FakeTokenizer())
    run(take_turn(coder, env, py(BUGGY_CODE)))
    coder.reset()
    assert coder.current_prompt is None and coder.reward_history == [] and coder.answer_history == []
    assert not coder.success and coder.agent_reward is None


def test_code_agents_refuse_other_envs() -> None:
    class Plain(Env):
        def initial_state(self) -> dict[str, Any]:
            return {}

    with pytest.raises(TypeError, match="need a CodeEnv"):
        CodeGeneratorAgent(tokenizer=FakeTokenizer()).update_from_env(0, Plain({}))


# --------------------------------------------------------------------------------------------------
# sample layouts
# --------------------------------------------------------------------------------------------------
def test_per_turn_layout_rebuilds_the_full_prompt() -> None:
    env = toy_env()
    coder = CodeGeneratorAgent(tokenizer=FakeTokenizer(), layout="per_turn")
    tester = UnitTestGeneratorAgent(tokenizer=FakeTokenizer(), agent_idx=1)
    run(take_turn(coder, env, py(BUGGY_CODE)))
    run(take_turn(tester, env, py("assert add(2, 3) == 5")))
    second = coder.update_from_env(2, env)
    assert [m["role"] for m in second.messages] == ["system", "user"]
    assert "Your previous code" in second.messages[1]["content"]


def test_per_episode_layout_appends_response_and_observation() -> None:
    tok = FakeTokenizer()
    env = toy_env()
    coder = CodeGeneratorAgent(tokenizer=tok, layout="per_episode")
    tester = UnitTestGeneratorAgent(tokenizer=tok, agent_idx=1, layout="per_episode")
    first = run(take_turn(coder, env, py(BUGGY_CODE)))
    run(take_turn(tester, env, py("assert add(2, 3) == 5")))
    second = coder.update_from_env(2, env)
    assert second.messages[: len(first.messages)] == first.messages
    assert second.messages[len(first.messages)] == {"role": "assistant", "content": py(BUGGY_CODE)}
    obs = second.messages[-1]
    assert (
        obs["role"] == "user" and "assert add(2, 3) == 5" in obs["content"] and "It fails these tests" in obs["content"]
    )
    assert TOY_TASK["prompt"].strip() not in obs["content"]  # only what changed, not the whole state again
    # append-only: the previous prompt's tokens are a prefix of the new prompt's tokens
    assert second.token_ids[: len(first.token_ids)] == first.token_ids
    # the tester's second call shows the updated code as an observation
    coder.update_from_model(2, env, py(GOOD_CODE.replace("a + b", "b + a")))
    run(coder.step(env))
    tester_second = tester.update_from_env(3, env)
    assert [m["role"] for m in tester_second.messages] == ["system", "user", "assistant", "user"]
    assert "The code was updated" in tester_second.messages[-1]["content"]


def test_invalid_layout_is_rejected() -> None:
    with pytest.raises(ValueError, match="layout must be one of"):
        CodeGeneratorAgent(layout="per_step")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# registry and building from config
# --------------------------------------------------------------------------------------------------
def test_agent_registry_resolves_names_and_paths() -> None:
    assert resolve_agent_class("code-generator") is CodeGeneratorAgent
    assert resolve_agent_class("unit-test-generator") is UnitTestGeneratorAgent
    assert resolve_agent_class("pettingflow.agents.code_agents:CodeGeneratorAgent") is CodeGeneratorAgent
    assert {"code-generator", "unit-test-generator"} <= set(registered_agents())
    with pytest.raises(RegistryError, match=r"unknown agent 'coder'; registered names: code-generator"):
        resolve_agent_class("coder")
    with pytest.raises(RegistryError, match="not a subclass of Agent"):
        resolve_agent_class("pettingflow.envs.code_env:CodeEnv")


def test_register_custom_agent() -> None:
    @register_agent("test-echo", replace=True)
    class Echo(CodeGeneratorAgent):
        default_name = "echo"

    assert resolve_agent_class("test-echo") is Echo


def test_build_agent_from_settings() -> None:
    settings = AgentSettings(
        name="coder", class_path="code-generator", policy="shared", sampling=SamplingSettings(temperature=0.5)
    )
    tok = FakeTokenizer()
    agent = build_agent(settings, agent_idx=0, tokenizer=tok, layout="per_episode")
    assert isinstance(agent, CodeGeneratorAgent)
    assert (agent.name, agent.agent_idx, agent.policy_name, agent.layout) == ("coder", 0, "shared", "per_episode")
    assert agent.sampling.temperature == 0.5 and agent.tokenizer is tok


def test_agents_only_share_the_env() -> None:
    # agents hold no reference to each other: nothing in an agent's attributes is another agent
    env = CodeEnv(TOY_TASK, {}, sandbox=FakeSandbox())
    coder = CodeGeneratorAgent(tokenizer=FakeTokenizer())
    tester = UnitTestGeneratorAgent(tokenizer=FakeTokenizer(), agent_idx=1)
    run(take_turn(coder, env, py(BUGGY_CODE)))
    run(take_turn(tester, env, py("assert add(2, 3) == 5")))
    for agent in (coder, tester):
        assert not any(isinstance(v, Agent) for v in vars(agent).values())
