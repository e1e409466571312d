"""What sdbench predicts and simulates, and the profiling those predictions stand on: the computation behind
`predict`, `simulate` and `reproduce`, whose command modules (commands/) only take input, print and write.

theory.py       expected-speedup formulas beyond the i.i.d. basics (engine/iid_model.py): Omega inverted, the
                accepted length's variance, polybasic chains and their insertion conditions, SI and DSI latencies
costs.py        step costs timed on this machine (`profile`, `measured_costs`) and MagicDec's cost model on them
chain.py        a polybasic chain profiled and measured, its costs (`ChainCosts`) and the insertion verdicts
dsi_sim.py      the DSI simulator: offline (counting forwards) and online (event-timed, on the real Ledger)
dsi_heatmap.py  the DSI paper's heat-maps over drafter latency and acceptance rate, and its lookahead rule

Analysis sits above the engine, the strategies and dsi/ (it drives them) and never imports the commands.
"""
