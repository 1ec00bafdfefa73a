"""What slmsql checks before any model loads: the Great Expectations suites on the RL band and eval sets
(`datachecks`) and the prompt's fit to the policy's template and token budget (`promptcheck`). Uses `inputs`,
`runtime`, `sql`.
"""
