"""What the GPU tests' driver scripts (run in processes of their own) share, prepended to a driver's text (after its
LAYERS): ``take``, an answer's file taken as speculators' client does; ``capture_kwargs``, hscapture's worker and KV
connector as ``vllm.LLM`` takes them."""

TAKE = r'''
import fcntl, os, shutil, time


def take(path, dest, limit_s=120):
    """Waits for the file's lock (free once the file is whole), then moves the file to ``dest`` and removes the lock."""
    with open(path + ".lock", "rb") as f:
        deadline = time.time() + limit_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.time() < deadline, f"{path} still locked after {limit_s} s"
                time.sleep(0.01)
    shutil.move(path, dest)
    os.unlink(path + ".lock")
'''

CAPTURE = r'''

def capture_kwargs(stage, fmt):
    """hscapture's worker (LAYERS, before convention) and KV connector writing `fmt` files into `stage`."""
    from vllm.config import KVTransferConfig

    return dict(worker_cls="hscapture.worker.CaptureWorker",
                additional_config={"hscapture": {"layers": LAYERS, "convention": "before"}},
                kv_transfer_config=KVTransferConfig(kv_connector="HscaptureConnector",
                    kv_connector_module_path="hscapture.connector", kv_role="kv_producer",
                    kv_connector_extra_config={"shared_storage_path": stage, "format": fmt}))
'''

HELPERS = TAKE + CAPTURE
