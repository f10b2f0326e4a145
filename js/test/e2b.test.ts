/**
 * E2B's own JS SDK (`@e2b/code-interpreter` from the registry, unmodified) against kernelhost's
 * E2B surface, through real VMs. tests/clients/agents/test_js.py sets E2B_API_URL,
 * E2B_SANDBOX_URL and E2B_API_KEY to the service's /e2b, /e2b/sandbox and key: the SDK's whole
 * configuration, as a user would set it.
 */

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';

import { CommandExitError, Sandbox } from '@e2b/code-interpreter';

import { SHOW_PNG } from './helpers.js';

let sbx: Sandbox;

before(async () => {
  assert.ok(process.env.E2B_API_URL?.endsWith('/e2b'), 'E2B_API_URL is not set to the service');
  sbx = await Sandbox.create({ metadata: { suite: 'e2b-js' } });
});

after(async () => {
  await sbx?.kill();
});

describe('@e2b/code-interpreter on kernelhost', () => {
  it('keeps state across runCode calls and streams stdout in order', async () => {
    await sbx.runCode('x = 41');
    const seen: string[] = [];
    const execution = await sbx.runCode("for i in range(3):\n    print('line', i)\nx + 1", {
      onStdout: (m) => {
        seen.push(m.line);
      },
    });
    assert.equal(execution.text, '42');
    assert.equal(seen.join(''), 'line 0\nline 1\nline 2\n');
    const failed = await sbx.runCode('def boom():\n    return 1 / 0\nboom()');
    assert.equal(failed.error?.name, 'ZeroDivisionError');
    assert.ok(failed.error?.traceback.includes('boom'));
  });

  it('writes, reads, lists and removes files; runs commands with their exit codes', async () => {
    await sbx.files.write('/home/user/js.txt', 'from node');
    assert.equal(await sbx.files.read('/home/user/js.txt'), 'from node');
    assert.ok((await sbx.files.list('/home/user')).some((e) => e.name === 'js.txt'));
    await sbx.files.remove('/home/user/js.txt');
    assert.equal(await sbx.files.exists('/home/user/js.txt'), false);
    const ok = await sbx.commands.run('echo hello; echo err >&2');
    assert.deepEqual([ok.stdout, ok.stderr, ok.exitCode], ['hello\n', 'err\n', 0]);
    await assert.rejects(sbx.commands.run('exit 4'), (e: unknown) => e instanceof CommandExitError && e.exitCode === 4);
  });

  it('lists, times out, pauses and connects again with the state intact', async () => {
    const listed = await Sandbox.list({ query: { metadata: { suite: 'e2b-js' } } }).nextItems();
    assert.deepEqual(
      listed.map((s) => s.sandboxId),
      [sbx.sandboxId],
    );
    const before = (await sbx.getInfo()).endAt.getTime();
    await sbx.setTimeout(900_000);
    assert.ok((await sbx.getInfo()).endAt.getTime() > before);
    await sbx.pause();
    const again = await Sandbox.connect(sbx.sandboxId);
    assert.equal((await again.runCode('x')).text, '41');
  });

  it('returns a PNG, stops a timed-out call, kills a background command and forks', async () => {
    const shown = await sbx.runCode(SHOW_PNG);
    assert.ok(shown.results.some((r) => Buffer.from(r.png ?? '', 'base64').subarray(0, 4).toString('latin1') === '\x89PNG'));
    await assert.rejects(sbx.runCode('import time; y = 5; time.sleep(60)', { timeoutMs: 3000 }));
    assert.equal((await sbx.runCode('y * 2', { requestTimeoutMs: 120_000 })).text, '10');
    const handle = await sbx.commands.run('echo started; sleep 120', { background: true });
    assert.ok(handle.pid > 0);
    assert.equal(await sbx.commands.kill(handle.pid), true);
    await assert.rejects(handle.wait());
    const [child] = await sbx.fork({ count: 1 });
    assert.ok(child instanceof Sandbox, String(child));
    try {
      assert.equal((await child.runCode('y')).text, '5');
    } finally {
      await child.kill();
    }
  });
});
