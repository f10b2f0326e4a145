/** Helpers shared by the tests. */

import type { Execution } from 'kernelhost';

/** An Execution value with the given fields (the rest empty), for offline tests. */
export function executionOf(fields: Partial<Omit<Execution, 'text'>>): Execution {
  const execution = {
    stdout: '',
    stderr: '',
    results: [],
    error: null,
    executionCount: null,
    durationMs: null,
    status: 'ok',
    exitCode: null,
    outputTruncated: false,
    ...fields,
    get text(): string | null {
      const main = execution.results.find((r) => r.isMainResult);
      const value = main?.data['text/plain'];
      return typeof value === 'string' ? value : null;
    },
  } as Execution;
  return execution;
}

/** The service under test, from the environment `tests/clients/test_js.py` sets. */
export function serviceFromEnv(): { url: string; apiKey: string } {
  const url = process.env.KERNELHOST_URL;
  const apiKey = process.env.KERNELHOST_API_KEY;
  if (!url || !apiKey) {
    throw new Error(
      'these tests drive a running kernelhost service: set KERNELHOST_URL and KERNELHOST_API_KEY ' +
        '(pytest -m clients tests/clients/test_js.py starts a service and sets them)',
    );
  }
  return { url, apiKey };
}

/** Python that displays a 4x4 red PNG without matplotlib (the minimal template has none). */
export const SHOW_PNG = [
  'import struct, zlib',
  'from IPython.display import Image, display',
  'def _chunk(kind, data):',
  "    return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data) & 0xffffffff)",
  "_raw = b''.join(b'\\x00' + b'\\xff\\x00\\x00' * 4 for _ in range(4))",
  "_png = (b'\\x89PNG\\r\\n\\x1a\\n' + _chunk(b'IHDR', struct.pack('>IIBBBBB', 4, 4, 8, 2, 0, 0, 0))",
  "        + _chunk(b'IDAT', zlib.compress(_raw)) + _chunk(b'IEND', b''))",
  'display(Image(data=_png))',
].join('\n');
