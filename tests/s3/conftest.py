"""Fixtures of the object-storage suite: the transfer options its stores use, and an S3 server
that checks credentials. Its ``store`` (a local directory or a bucket of the local S3 server:
the same tests run on both) is in ``tests/conftest.py``, shared with ``tests/testing/``."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Iterator

import pytest

from keyedstate.storage.transfer import KiB, MiB, TransferOptions
from keyedstate.testing.s3 import start_moto_server, stop_moto_server

#: Inlining and merging on for both stores (a local disk has them off by default), small
#: enough that a test's few thousand keys produce inline, merged and plain files.
TRANSFER = TransferOptions(inline_threshold=2 * KiB, merge_file_size=64 * KiB,
                           merge_max_size=1 * MiB, backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture(scope="session")
def auth_s3() -> Iterator[dict[str, Any]]:
    """A local S3 server that checks credentials (moto's IAM auth after its first 3 calls),
    with a bucket and a user allowed everything: yields ``endpoint``, ``bucket``, ``key``,
    ``secret``."""
    import boto3

    try:
        proc, endpoint = start_moto_server(dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3"))
    except RuntimeError as exc:
        pytest.fail(f"with auth: {exc}")
    try:
        iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1",
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="keyedstate")
        key = iam.create_access_key(UserName="keyedstate")["AccessKey"]
        iam.put_user_policy(UserName="keyedstate", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17",
             "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        bucket = f"ks-auth-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id=key["AccessKeyId"],
                     aws_secret_access_key=key["SecretAccessKey"]).create_bucket(Bucket=bucket)
        yield {"endpoint": endpoint, "bucket": bucket, "key": key["AccessKeyId"],
               "secret": key["SecretAccessKey"]}
    finally:
        stop_moto_server(proc, timeout_s=10)


__all__ = ["MiB", "TRANSFER"]
