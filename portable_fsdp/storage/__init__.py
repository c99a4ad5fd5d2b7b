"""A workdir in object storage (s3://, gs://): a local working copy synchronised with the bucket. Imports no
framework."""
