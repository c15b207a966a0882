"""The worker's timings that the simulator (tools/sim) reproduces, in a module that loads nothing: the simulator
reads the very values the workers use without importing them (they load torch)."""

RETRY_FULL_AFTER_S = 0.05  # a decode worker with no room is asked again after this long
GIVE_UP_TRANSFER_S = 60.0  # a transfer no decode worker took by then is dropped; the gateway moves the request
CACHE_SYNC_S = 30.0  # between full CacheUpdates: how long a lost update can leave a gateway's view stale
