"""Push a run folder's dataset to the Hub or a bucket: `python -m tools.publish OUTPUT_DIR TARGET [--no-images]`.

TARGET: hf://datasets/ORG/NAME[@REVISION], s3://BUCKET/PATH or gs://BUCKET/PATH. Only the dataset goes (data
files, the card, image files when asked or when the Parquet rows point at them); the same command uploads only
what the target lacks or holds otherwise. See launcher/publish/push.py.
"""

import sys

from launcher.publish.push import main

if __name__ == "__main__":
    sys.exit(main())
