"""Smoke tests of the S3 server the object-storage tests run against (Ceph radosgw 16.2, tests/s3server.py),
through boto3. Where radosgw differs from AWS S3 the assertions document what this server does, so that a
change of server (or of its version) shows up here first."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

MiB = 1 << 20


def error_of(call: Callable[[], Any]) -> tuple[str, int]:
    """(error code, HTTP status) of a call that must fail."""
    with pytest.raises(ClientError) as info:
        call()
    return info.value.response["Error"]["Code"], info.value.response["ResponseMetadata"]["HTTPStatusCode"]


@pytest.fixture
def s3(s3_server):
    return s3_server.client()


def _read(s3, bucket: str, key: str, **kw: Any) -> bytes:
    return s3.get_object(Bucket=bucket, Key=key, **kw)["Body"].read()


# --- basics -----------------------------------------------------------------------------------------------
def test_every_test_here_is_marked_s3(request) -> None:
    assert request.node.get_closest_marker("s3") is not None


def test_put_get_head(s3, s3_bucket) -> None:
    data = os.urandom(100_000)
    etag = s3.put_object(Bucket=s3_bucket, Key="dir/obj", Body=data)["ETag"]
    assert _read(s3, s3_bucket, "dir/obj") == data
    head = s3.head_object(Bucket=s3_bucket, Key="dir/obj")
    assert head["ContentLength"] == len(data) and head["ETag"] == etag and etag.startswith('"')


def test_each_test_gets_a_fresh_empty_bucket(s3, s3_server, s3_bucket) -> None:
    assert s3.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 0
    other = s3_server.new_bucket()
    try:
        assert other != s3_bucket
    finally:
        s3_server.empty_and_delete_bucket(other)


def test_ranged_get(s3, s3_bucket) -> None:
    data = os.urandom(3 * MiB + 17)
    s3.put_object(Bucket=s3_bucket, Key="obj", Body=data)
    for first, last in [(0, 0), (5, 1000), (MiB - 3, 2 * MiB + 5), (len(data) - 10, len(data) - 1)]:
        resp = s3.get_object(Bucket=s3_bucket, Key="obj", Range=f"bytes={first}-{last}")
        assert resp["Body"].read() == data[first:last + 1]
        assert resp["ContentRange"] == f"bytes {first}-{last}/{len(data)}"
        assert resp["ResponseMetadata"]["HTTPStatusCode"] == 206
    # a range running past the end is cut at the end; a suffix range gives the last bytes
    resp = s3.get_object(Bucket=s3_bucket, Key="obj", Range=f"bytes={len(data) - 5}-{len(data) + 100}")
    assert resp["Body"].read() == data[-5:]
    assert _read(s3, s3_bucket, "obj", Range="bytes=-7") == data[-7:]
    # a range starting past the end: 416 InvalidRange, as on AWS
    assert error_of(lambda: s3.get_object(Bucket=s3_bucket, Key="obj", Range=f"bytes={len(data)}-{len(data) + 9}")) \
        == ("InvalidRange", 416)


def test_copy_object(s3, s3_bucket) -> None:
    data = os.urandom(6 * MiB)
    s3.put_object(Bucket=s3_bucket, Key="src", Body=data)
    s3.copy_object(Bucket=s3_bucket, Key="dst", CopySource={"Bucket": s3_bucket, "Key": "src"})
    assert _read(s3, s3_bucket, "dst") == data


# --- multipart --------------------------------------------------------------------------------------------
def _upload_parts(s3, bucket: str, key: str, parts: list[bytes]) -> tuple[str, list[dict[str, Any]]]:
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    done = [{"PartNumber": i, "ETag": s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=i,
                                                     Body=part)["ETag"]}
            for i, part in enumerate(parts, 1)]
    return upload_id, done


def test_multipart_upload_complete(s3, s3_bucket) -> None:
    parts = [os.urandom(5 * MiB), os.urandom(5 * MiB), os.urandom(123)]  # every part but the last >= 5 MiB
    upload_id, done = _upload_parts(s3, s3_bucket, "mp", parts)
    listed = s3.list_parts(Bucket=s3_bucket, Key="mp", UploadId=upload_id)["Parts"]
    assert [p["Size"] for p in listed] == [len(p) for p in parts]
    resp = s3.complete_multipart_upload(Bucket=s3_bucket, Key="mp", UploadId=upload_id,
                                        MultipartUpload={"Parts": done})
    # radosgw 16.2 answers with an empty <ETag/> and no ETag header (AWS gives the object's ETag):
    # a client that needs the ETag must HEAD the object.
    assert resp.get("ETag", "") == "" and "etag" not in resp["ResponseMetadata"]["HTTPHeaders"]
    assert s3.head_object(Bucket=s3_bucket, Key="mp")["ETag"].endswith('-3"')
    assert _read(s3, s3_bucket, "mp") == b"".join(parts)
    whole = b"".join(parts)
    assert _read(s3, s3_bucket, "mp", Range=f"bytes={5 * MiB - 10}-{5 * MiB + 9}") == whole[5 * MiB - 10:5 * MiB + 10]
    assert s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_multipart_part_under_5_mib_is_refused(s3, s3_bucket) -> None:
    upload_id, done = _upload_parts(s3, s3_bucket, "mp", [b"x" * MiB, b"y"])
    assert error_of(lambda: s3.complete_multipart_upload(
        Bucket=s3_bucket, Key="mp", UploadId=upload_id, MultipartUpload={"Parts": done})) == ("EntityTooSmall", 400)
    s3.abort_multipart_upload(Bucket=s3_bucket, Key="mp", UploadId=upload_id)


def test_multipart_upload_abort(s3, s3_bucket) -> None:
    upload_id, done = _upload_parts(s3, s3_bucket, "mp", [os.urandom(5 * MiB)])
    assert [u["UploadId"] for u in s3.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]] == [upload_id]
    s3.abort_multipart_upload(Bucket=s3_bucket, Key="mp", UploadId=upload_id)
    assert s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert error_of(lambda: s3.head_object(Bucket=s3_bucket, Key="mp")) == ("404", 404)
    assert error_of(lambda: s3.abort_multipart_upload(Bucket=s3_bucket, Key="mp", UploadId=upload_id)) \
        == ("NoSuchUpload", 404)
    assert error_of(lambda: s3.upload_part(Bucket=s3_bucket, Key="mp", UploadId=upload_id, PartNumber=2,
                                           Body=b"z")) == ("NoSuchUpload", 404)
    # Completing an aborted upload: radosgw 16.2 says 500 InternalError ("This multipart completion is
    # already in progress"); AWS says 404 NoSuchUpload.
    assert error_of(lambda: s3.complete_multipart_upload(
        Bucket=s3_bucket, Key="mp", UploadId=upload_id, MultipartUpload={"Parts": done})) == ("InternalError", 500)
    assert error_of(lambda: s3.head_object(Bucket=s3_bucket, Key="mp")) == ("404", 404)


# --- listing and deleting ---------------------------------------------------------------------------------
def test_list_objects_v2_with_prefix(s3, s3_bucket) -> None:
    keys = ["ckpt/a/.metadata", "ckpt/a/__0_0.distcp", "ckpt/a/__1_0.distcp", "ckpt/ab/x", "other/y"]
    for key in keys:
        s3.put_object(Bucket=s3_bucket, Key=key, Body=key.encode())
    listed = s3.list_objects_v2(Bucket=s3_bucket, Prefix="ckpt/a/")
    assert [o["Key"] for o in listed["Contents"]] == sorted(keys[:3])
    assert [o["Size"] for o in listed["Contents"]] == [len(k) for k in sorted(keys[:3])]
    by_dir = s3.list_objects_v2(Bucket=s3_bucket, Prefix="ckpt/", Delimiter="/")
    assert [p["Prefix"] for p in by_dir["CommonPrefixes"]] == ["ckpt/a/", "ckpt/ab/"] and "Contents" not in by_dir
    pages = list(s3.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket, PaginationConfig={"PageSize": 2}))
    assert len(pages) == 3 and [o["Key"] for p in pages for o in p["Contents"]] == sorted(keys)
    assert s3.list_objects_v2(Bucket=s3_bucket, Prefix="nothing/")["KeyCount"] == 0


def test_delete_objects(s3, s3_bucket) -> None:
    for key in ("a", "b", "c"):
        s3.put_object(Bucket=s3_bucket, Key=key, Body=b"1")
    resp = s3.delete_objects(Bucket=s3_bucket, Delete={"Objects": [{"Key": "a"}, {"Key": "b"}, {"Key": "never"}]})
    assert sorted(d["Key"] for d in resp["Deleted"]) == ["a", "b", "never"]  # a missing key counts as deleted
    assert resp.get("Errors", []) == []
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"]] == ["c"]
    s3.delete_object(Bucket=s3_bucket, Key="never")  # deleting a missing key succeeds (204), as on AWS


# --- errors -----------------------------------------------------------------------------------------------
def test_missing_key(s3, s3_bucket) -> None:
    assert error_of(lambda: s3.get_object(Bucket=s3_bucket, Key="missing")) == ("NoSuchKey", 404)
    assert error_of(lambda: s3.head_object(Bucket=s3_bucket, Key="missing")) == ("404", 404)  # HEAD has no body
    assert error_of(lambda: s3.get_object(Bucket=s3_bucket, Key="missing", Range="bytes=0-9")) == ("NoSuchKey", 404)


def test_missing_bucket(s3) -> None:
    bucket = "mmapckpt-no-such-bucket"
    assert error_of(lambda: s3.get_object(Bucket=bucket, Key="k")) == ("NoSuchBucket", 404)
    assert error_of(lambda: s3.list_objects_v2(Bucket=bucket)) == ("NoSuchBucket", 404)
    assert error_of(lambda: s3.put_object(Bucket=bucket, Key="k", Body=b"1")) == ("NoSuchBucket", 404)
    assert error_of(lambda: s3.head_bucket(Bucket=bucket)) == ("404", 404)


def test_bucket_errors(s3, s3_bucket) -> None:
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"1")
    assert error_of(lambda: s3.delete_bucket(Bucket=s3_bucket)) == ("BucketNotEmpty", 409)
    assert error_of(lambda: s3.create_bucket(Bucket="Not_A_Valid_Name")) == ("InvalidBucketName", 400)


def test_wrong_credentials(s3_server, s3_bucket) -> None:
    s3_server.client().put_object(Bucket=s3_bucket, Key="k", Body=b"1")
    unknown_key = s3_server.client(aws_access_key_id="NOSUCHACCESSKEY00000")
    assert error_of(lambda: unknown_key.get_object(Bucket=s3_bucket, Key="k")) == ("InvalidAccessKeyId", 403)
    assert error_of(lambda: unknown_key.list_objects_v2(Bucket=s3_bucket)) == ("InvalidAccessKeyId", 403)
    wrong_secret = s3_server.client(aws_secret_access_key="not-the-secret")
    assert error_of(lambda: wrong_secret.get_object(Bucket=s3_bucket, Key="k")) == ("SignatureDoesNotMatch", 403)
    assert error_of(lambda: wrong_secret.put_object(Bucket=s3_bucket, Key="k2", Body=b"2")) \
        == ("SignatureDoesNotMatch", 403)
    assert error_of(lambda: wrong_secret.head_object(Bucket=s3_bucket, Key="k")) == ("403", 403)


def test_anonymous_access_is_denied(s3_server, s3_bucket) -> None:
    from botocore import UNSIGNED
    from botocore.config import Config

    anonymous = s3_server.client(config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"}))
    assert error_of(lambda: anonymous.list_objects_v2(Bucket=s3_bucket)) == ("AccessDenied", 403)
    assert error_of(lambda: anonymous.put_object(Bucket=s3_bucket, Key="k", Body=b"1")) == ("AccessDenied", 403)


# --- conditional requests ---------------------------------------------------------------------------------
def test_put_if_none_match_star(s3, s3_bucket) -> None:
    """Honoured, as on AWS: a create-only PUT on an existing key is refused with 412 and changes nothing."""
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"first")
    assert error_of(lambda: s3.put_object(Bucket=s3_bucket, Key="k", Body=b"second", IfNoneMatch="*")) \
        == ("PreconditionFailed", 412)
    assert _read(s3, s3_bucket, "k") == b"first"
    s3.put_object(Bucket=s3_bucket, Key="new", Body=b"created", IfNoneMatch="*")
    assert _read(s3, s3_bucket, "new") == b"created"


def test_put_if_none_match_star_lets_exactly_one_racer_win(s3_server, s3_bucket) -> None:
    writers = 6
    clients = [s3_server.client() for _ in range(writers)]
    for round_ in range(5):
        key = f"race-{round_}"
        barrier = threading.Barrier(writers, timeout=60)
        outcome: dict[int, str] = {}

        def write(i: int, key: str = key, barrier: threading.Barrier = barrier,
                  outcome: dict[int, str] = outcome) -> None:
            barrier.wait()
            try:
                clients[i].put_object(Bucket=s3_bucket, Key=key, Body=str(i).encode(), IfNoneMatch="*")
                outcome[i] = "ok"
            except ClientError as exc:
                outcome[i] = exc.response["Error"]["Code"]

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert sorted(outcome.values()) == ["PreconditionFailed"] * (writers - 1) + ["ok"], outcome
        winner = next(i for i, o in outcome.items() if o == "ok")
        assert _read(s3_server.client(), s3_bucket, key) == str(winner).encode()


def test_put_if_match(s3, s3_bucket) -> None:
    """radosgw 16.2 compares If-Match with the stored ETag *without* its quotes: the quoted ETag that S3
    returns (and that AWS expects back) never matches, so a compare-and-swap PUT fails with 412 there;
    the bare hex digest matches. A wrong ETag gives 412, `*` matches any existing object, and on a
    missing key If-Match gives 412 (AWS: 404 NoSuchKey)."""
    etag = s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v1")["ETag"]
    assert etag.startswith('"') and etag.endswith('"')
    assert error_of(lambda: s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v2", IfMatch=etag)) \
        == ("PreconditionFailed", 412)  # AWS would accept this one
    assert error_of(lambda: s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v2", IfMatch='"' + "0" * 32 + '"')) \
        == ("PreconditionFailed", 412)
    assert error_of(lambda: s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v2", IfMatch="0" * 32)) \
        == ("PreconditionFailed", 412)
    assert _read(s3, s3_bucket, "k") == b"v1"
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v2", IfMatch=etag.strip('"'))
    assert _read(s3, s3_bucket, "k") == b"v2"
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v3", IfMatch="*")
    assert _read(s3, s3_bucket, "k") == b"v3"
    assert error_of(lambda: s3.put_object(Bucket=s3_bucket, Key="missing", Body=b"x", IfMatch="*")) \
        == ("PreconditionFailed", 412)
    assert error_of(lambda: s3.head_object(Bucket=s3_bucket, Key="missing")) == ("404", 404)


def test_complete_multipart_upload_ignores_conditions(s3, s3_bucket) -> None:
    """radosgw 16.2 ignores If-None-Match and If-Match on CompleteMultipartUpload (AWS honours both):
    a create-only multipart upload silently replaces an existing object."""
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"existing")
    part = os.urandom(5 * MiB)
    upload_id, done = _upload_parts(s3, s3_bucket, "k", [part])
    s3.complete_multipart_upload(Bucket=s3_bucket, Key="k", UploadId=upload_id, MultipartUpload={"Parts": done},
                                 IfNoneMatch="*")
    assert _read(s3, s3_bucket, "k") == part  # overwritten: no 412
    upload_id, done = _upload_parts(s3, s3_bucket, "k", [part[::-1]])
    s3.complete_multipart_upload(Bucket=s3_bucket, Key="k", UploadId=upload_id, MultipartUpload={"Parts": done},
                                 IfMatch='"' + "0" * 32 + '"')
    assert _read(s3, s3_bucket, "k") == part[::-1]


def test_conditional_get(s3, s3_bucket) -> None:
    """GET and HEAD honour If-Match / If-None-Match with the quoted ETag, as on AWS."""
    etag = s3.put_object(Bucket=s3_bucket, Key="k", Body=b"0123456789")["ETag"]
    assert _read(s3, s3_bucket, "k", IfMatch=etag, Range="bytes=2-4") == b"234"
    assert error_of(lambda: s3.get_object(Bucket=s3_bucket, Key="k", IfMatch='"' + "0" * 32 + '"')) \
        == ("PreconditionFailed", 412)
    assert error_of(lambda: s3.head_object(Bucket=s3_bucket, Key="k", IfMatch='"' + "0" * 32 + '"')) == ("412", 412)
    assert error_of(lambda: s3.get_object(Bucket=s3_bucket, Key="k", IfNoneMatch=etag)) == ("304", 304)


# --- the environment a library sees -----------------------------------------------------------------------
def test_s3_env_alone_configures_boto3(s3_env, s3_bucket) -> None:
    assert set(s3_env) == {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"}
    assert "AWS_PROFILE" not in os.environ
    s3 = boto3.session.Session().client("s3")  # endpoint, keys and region from the environment only
    assert s3.meta.endpoint_url == s3_env["AWS_ENDPOINT_URL"]
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"via env")
    assert _read(s3, s3_bucket, "k") == b"via env"


def test_s3_env_alone_configures_s3fs(s3_env, s3_bucket) -> None:
    s3fs = pytest.importorskip("s3fs")
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    with fs.open(f"{s3_bucket}/dir/obj", "wb") as f:
        f.write(b"via s3fs")
    assert fs.cat_file(f"{s3_bucket}/dir/obj", start=4, end=8) == b"s3fs"
    assert fs.ls(f"{s3_bucket}/dir", detail=False) == [f"{s3_bucket}/dir/obj"]
