"""The client's start-up check (health, served model; every bad URL named) and its re-discovery of a served model
name after a server restart under another name, against real scripted servers on loopback; and the rollout loop
stopping when simulator errors persist."""
from __future__ import annotations

import pytest

from llm_agent.user_sim.client import SimulatorCheckError, TurnRequest, UserSimClient

from tests.helpers.repo import SCENARIO_PATH
from tests.helpers.sim_servers import SimServers, free_port
from tests.helpers.profiles import profile3

SCENARIO = str(SCENARIO_PATH)


@pytest.fixture()
def servers(tmp_path):
    s = SimServers(tmp_path)
    yield s
    s.stop_all()


def _request(scenario_messages):
    return TurnRequest("d#0", scenario_messages, max_tokens=64, seed=1)


@pytest.mark.processes
def test_start_up_check_names_each_dead_or_wrong_instance(servers):
    good = servers.start("--scenario", SCENARIO, "--served-model-name", "sim-a")
    other = servers.start("--scenario", SCENARIO, "--served-model-name", "sim-b")
    servers.wait_ready(good, other)
    dead_host = f"127.0.0.1:{free_port()}"
    dead = f"http://{dead_host}"
    with UserSimClient([good, other], timeout_s=5) as client:
        assert client.check_instances() == {good.split("//")[1]: "sim-a", other.split("//")[1]: "sim-b"}
    with UserSimClient([good, other, dead], model="sim-a", timeout_s=5) as client:
        with pytest.raises(SimulatorCheckError) as err:
            client.check_instances(timeout_s=2)
    message = str(err.value)
    assert good.split("//")[1] not in message
    assert f"{other.split('//')[1]}: serves ['sim-b'], not the configured model 'sim-a'" in message
    assert f"{dead_host}: unreachable" in message


@pytest.mark.processes
def test_a_restart_under_another_served_name_is_picked_up_unless_the_model_was_configured(servers, scenario):
    from llm_agent.user_sim.client import TurnFailure

    port = free_port()
    url = servers.start("--scenario", SCENARIO, "--served-model-name", "before", port=port)
    servers.wait_ready(url)
    messages = [{"role": "system", "content": scenario.render_user_prompt(profile3(3, 2, 3))},
                {"role": "user", "content": "Hello, this is Mia from FoodLoop."}]
    discovered = UserSimClient([url], timeout_s=10, max_attempts=1)
    configured = UserSimClient([url], model="before", timeout_s=10, max_attempts=1)
    try:
        for client in (discovered, configured):
            assert client.complete([_request(messages)])[0].text
        servers.kill(url)
        del servers.procs[url]
        servers.wait_ready(servers.start("--scenario", SCENARIO, "--served-model-name", "after", port=port))
        reply = discovered.complete([_request(messages)])[0]
        assert getattr(reply, "text", None), reply  # the 404 for 'before' led to asking /v1/models again
        failure = configured.complete([_request(messages)])[0]
        assert isinstance(failure, TurnFailure) and "404" in failure.reason  # the user's choice is not replaced
    finally:
        discovered.close()
        configured.close()
