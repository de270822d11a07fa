"""The OpenAI-compatible model API a rollout worker serves to agents, and the recording that trains on it.

    server.py       EndpointServer: uvicorn on the worker's loop; open_episode / close_episode for the worker
    app.py          routes, the episode check, error shapes          errors.py   OpenAI's error body
    sessions.py     episodes: session key, token, limits             schemas.py  request bodies
    chat.py, completions.py, responses.py                            the routes' answers
    render.py       messages -> prompt ids, splicing recorded ids    generation.py  engine call, span, metrics
    recording.py    an episode's calls                               trajectory.py  calls -> samples (pure)

docs/agents.md is the contract.
"""
