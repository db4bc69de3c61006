"""The verl recipes' rules (tests/verl_examples), in one place: the declared recipe variables
(`variables`), one reading of a verl command (`command`, also what `npu-flashrl verify
--verl-overrides` reads), the override schema lint (`lint`) and `npu-flashrl preflight`
(`preflight`), which every recipe calls before anything starts. The shell keeps defaults and
command assembly only."""
