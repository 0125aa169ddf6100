"""`python -m agent.worker`: the job subprocess."""
import sys

from agent.worker import main

sys.exit(main())
