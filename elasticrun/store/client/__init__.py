"""The clients of the built-in store server: the agents' async one, the workers' blocking one, and what both share.

Nothing here imports the server (`elasticrun.store.server`): a training script that talks
to the store loads only this side (an import contract in pyproject.toml).
"""
