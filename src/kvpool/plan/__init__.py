"""`kvpool plan`: a capacity planner that replays a request trace through the pool's own eviction.

    trace     the trace format and its reader
    scale     real capacities as a small engine making the same eviction decisions
    pool      one shared pool (engine memory tier + the disk tier's quota policy), no bytes
    replay    hit accounting, and a replay straight to the pool
    cluster   N instances with local prefix caches, routed by ``kvpool.routing``
    sweep     the grid of replays a plan runs, in parallel
    report    table, JSON and plot
    command   the CLI flags and the run
"""
