"""Where work runs: the process group and its ranks (`distributed`), sampling seeds (`seeds`), and output folders
staged so a crash never leaves a partial one (`outputs`). Uses `inputs`.
"""
