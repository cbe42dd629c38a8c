"""`python -m llm_agent.user_sim.server`: serve the simulator (arguments: `llm_agent.user_sim.server.app`)."""
from llm_agent.user_sim.server.app import main

main()
