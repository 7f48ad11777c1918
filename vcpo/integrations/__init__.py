"""VCPO inside other RL frameworks (docs/integrations.md). Each submodule imports its framework: import
`vcpo.integrations.trl` only where the `[trl]` extra is installed."""
