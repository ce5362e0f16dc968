"""`python -m jaxhq` runs the command line (`jaxhq train | plan | bench`)."""
import sys

from .cli import main

sys.exit(main())
