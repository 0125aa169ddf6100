"""Where the inference app talks to the daemon: the unix socket (``server``: peer checks, one
bounded JSON line, rate limits) and its requests, answered on the daemon's loop
(``requests``)."""
