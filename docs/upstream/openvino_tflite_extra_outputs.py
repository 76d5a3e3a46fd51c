"""OpenVINO TFLite frontend: SIGSEGV in FrontEnd::translate_graph when an operator lists
more outputs than its translation produces.

Uses only openvino (and the standard library). The model is a valid 344-byte TFLite
flatbuffer, y = RELU(x) with x, y f32[1, 4]; byte 224 is the length of the RELU
operator's ``outputs`` vector (1). Set to 2 or 3, the operator lists the outputs
[1, 1] or [1, 1, 0]: every index names an existing tensor, yet ``Core.read_model``
kills the process. Each read runs in a child process so that this script survives it.
"""

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import openvino as ov

RELU_TFLITE = bytes.fromhex(
    "0800000054464c338effffff24000000100000002c00000030000000030000000b000000776173696e6e2072"
    "656c750003000000280000001c0000001400000001000000440000000100000020000000f8fffffffcffffff"
    "04000400040000000c000e000d000000080004000c000000130000000100000000130e001800140010000c00"
    "080004000e000000140000001c000000200000002400000054000000040000006d61696e0000000001000000"
    "200000000100000001000000010000000000000000000a0010000c00080004000a0000000c00000010000000"
    "0000000001000000010000000100000000000000020000003c00000004000000d8ffffff1c00000002000000"
    "000000000400000002000000010000000400000001000000790000000c00140010000f00080004000c000000"
    "1c0000000100000000000000040000000200000001000000040000000100000078000000"
)
OUTPUT_COUNT = 224  # offset of the RELU operator's outputs-vector length

CHILD = """
import sys, faulthandler
faulthandler.enable()
import numpy as np, openvino as ov
model = ov.Core().read_model(sys.argv[1])
compiled = ov.Core().compile_model(model, "CPU")
print("read and ran:", compiled(np.array([[-1, 2, -3, 4]], np.float32))[0].tolist())
"""


def main() -> None:
    print("openvino", ov.get_version())
    assert RELU_TFLITE[OUTPUT_COUNT] == 1
    with tempfile.TemporaryDirectory() as tmp:
        for count in (1, 2, 3, 4):
            data = bytearray(RELU_TFLITE)
            data[OUTPUT_COUNT] = count
            path = Path(tmp) / f"relu_{count}_outputs.tflite"
            path.write_bytes(data)
            done = subprocess.run([sys.executable, "-c", CHILD, str(path)],
                                  capture_output=True, text=True, timeout=120, check=False)
            if done.returncode < 0:
                how = f"killed by {signal.Signals(-done.returncode).name}"
                where = [line for line in done.stderr.splitlines() if "line" in line][-1:]
                how += f" ({where[0].strip()})" if where else ""
            elif done.returncode:
                how = "exception: " + done.stderr.strip().splitlines()[-1][:200]
            else:
                how = done.stdout.strip()
            print(f"outputs vector length {count}: {how}")


if __name__ == "__main__":
    main()
