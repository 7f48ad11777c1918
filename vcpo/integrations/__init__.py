"""VCPO inside other RL frameworks (docs/integrations.md). Each submodule imports its framework: import
`vcpo.integrations.trl` only where the `[trl]` extra is installed, `vcpo.integrations.verl` (which verl itself loads
through the `verl.plugins` entry point) where verl is."""
