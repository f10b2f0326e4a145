/**
 * The npm package against a running kernelhost service (real VMs), driven by the real client
 * libraries offline: `ai`'s MockLanguageModelV4 through generateText, `@openai/agents` with its
 * ScriptedModel, and `@anthropic-ai/sdk` against a scripted local Messages API.
 *
 * Run by tests/clients/test_js.py, which starts the service and sets KERNELHOST_URL and
 * KERNELHOST_API_KEY. One sandbox is shared by most tests (a VM is expensive here).
 */

import assert from 'node:assert/strict';
import { type IncomingMessage, type ServerResponse, createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, describe, it } from 'node:test';

import Anthropic from '@anthropic-ai/sdk';
import { Agent, run, setTracingDisabled, tool as agentsTool } from '@openai/agents';
import { ScriptedModel, assistantMessage, functionCall } from '@openai/agents-core/testing';
import { generateText, isStepCount, tool as aiTool } from 'ai';
import { MockLanguageModelV4 } from 'ai/test';
import { KernelHostError, NotFoundError, Sandbox } from 'kernelhost';
import { codeExecutionTool, handleCodeExecutionToolUse } from 'kernelhost/anthropic';
import { type RunCodeOutput, kernelhostRunCode } from 'kernelhost/ai-sdk';
import { kernelhostCodeInterpreter } from 'kernelhost/openai-agents';

import { SHOW_PNG, serviceFromEnv } from './helpers.js';

const service = serviceFromEnv();
let sbx: Sandbox;

before(async () => {
  sbx = await Sandbox.create({ template: 'python', ...service, metadata: { test: 'js' } });
});

after(async () => {
  await sbx?.close();
});

describe('Sandbox', () => {
  it('runs code with state, streaming stdout before the call resolves', async () => {
    const seen: Array<[number, string]> = [];
    await sbx.runCode('counter = 41');
    const execution = await sbx.runCode(
      "import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')\ncounter += 1\ncounter",
      { onStdout: (text) => seen.push([Date.now(), text]) },
    );
    const done = Date.now();
    assert.equal(execution.stdout, 'first\nsecond\n');
    assert.equal(execution.text, '42');
    assert.equal(execution.status, 'ok');
    assert.ok(seen[0]![0] < done - 1500, 'the first line arrived while the cell was still sleeping');
  });

  it('reports an error in the code as a value, with rich results and a timeout status', async () => {
    const failed = await sbx.runCode('def boom():\n    return 1 / 0\nboom()');
    assert.equal(failed.status, 'error');
    assert.equal(failed.error?.name, 'ZeroDivisionError');
    assert.ok(failed.error?.traceback.some((line) => line.includes('boom')));
    const rich = await sbx.runCode("from IPython.display import HTML, display\ndisplay(HTML('<b>x</b>'))\n'v'");
    assert.deepEqual(rich.results.map((r) => r.isMainResult), [false, true]);
    assert.equal(rich.results[0]!.data['text/html'], '<b>x</b>');
    const slow = await sbx.runCode('import time\ntime.sleep(30)', { timeoutSeconds: 1 });
    assert.equal(slow.status, 'timeout');
    assert.equal((await sbx.runCode('counter')).text, '42', 'state survives the interrupt');
  });

  it('interrupts a running call, keeping the state', async () => {
    let started: () => void = () => undefined;
    const began = new Promise<void>((resolve) => (started = resolve));
    const running = sbx.runCode("print('started', flush=True)\nimport time\nfor i in range(300):\n    time.sleep(0.1)", {
      onStdout: () => started(),
    });
    await began; // the call is running: interrupt it
    assert.equal(await sbx.interrupt(), true);
    const stopped = await running;
    assert.equal(stopped.status, 'interrupted');
    assert.equal(stopped.error?.name, 'KeyboardInterrupt');
    assert.equal((await sbx.runCode('counter')).text, '42');
  });

  it('reads, writes and lists files', async () => {
    await sbx.files.write('/tmp/js/notes.txt', 'héllo\n');
    await sbx.files.write('/tmp/js/blob.bin', new Uint8Array([0, 255, 1, 254]));
    assert.equal(await sbx.files.readText('/tmp/js/notes.txt'), 'héllo\n');
    assert.deepEqual([...(await sbx.files.read('/tmp/js/blob.bin'))], [0, 255, 1, 254]);
    assert.deepEqual((await sbx.files.list('/tmp/js')).map((e) => [e.name, e.type, e.size]), [
      ['blob.bin', 'file', 4],
      ['notes.txt', 'file', 7],
    ]);
    assert.equal((await sbx.runCode("open('/tmp/js/notes.txt').read()")).text, "'héllo\\n'");
    await assert.rejects(sbx.files.read('/tmp/js/missing'), NotFoundError);
    await sbx.files.remove('/tmp/js', { recursive: true });
    assert.equal((await sbx.runCode("import os; os.path.exists('/tmp/js')")).text, 'False');
    const bash = await sbx.runCode('echo $((6 * 7)); exit 4', { language: 'bash' });
    assert.deepEqual([bash.stdout, bash.exitCode, bash.status], ['42\n', 4, 'error']);
  });

  it('connects, lists, and maps errors', async () => {
    const again = await Sandbox.connect(sbx.id, service);
    assert.equal(again.id, sbx.id);
    assert.ok((await Sandbox.list(service)).some((info) => info.id === sbx.id));
    await assert.rejects(Sandbox.connect('sbx_does_not_exist', service), NotFoundError);
    await assert.rejects(Sandbox.create({ url: service.url, apiKey: 'wrong-key-0123456789' }), /invalid API key/);
  });
});

describe('network', () => {
  it('is none by default and set per sandbox at create', { timeout: 240_000 }, async () => {
    assert.deepEqual(sbx.info.network, { mode: 'none', allow: [] });
    const online = await Sandbox.create({ ...service, network: { mode: 'allowlist', allow: ['files.example.org:443'] } });
    try {
      assert.deepEqual(online.info.network, { mode: 'allowlist', allow: ['files.example.org:443'] });
      const proxy = await online.runCode('echo $HTTPS_PROXY', { language: 'bash' });
      assert.equal(proxy.stdout.trim(), 'http://127.0.0.1:3128');
    } finally {
      await online.close();
    }
    await assert.rejects(Sandbox.create({ ...service, network: 'open' as never }), /network mode 'open'/);
  });
});

describe('Sandbox.fork', () => {
  it('copies a live sandbox: children keep its state and diverge from it', { timeout: 240_000 }, async (t) => {
    const parent = await Sandbox.create({ ...service });
    try {
      await parent.runCode("shared = ['parent']");
      const children = await parent.fork(2);
      try {
        assert.equal(children.length, 2);
        await children[0]!.runCode("shared.append('child0')");
        assert.equal((await children[0]!.runCode('shared')).text, "['parent', 'child0']");
        assert.equal((await children[1]!.runCode('shared')).text, "['parent']");
        assert.equal((await parent.runCode('shared')).text, "['parent']");
      } finally {
        await Promise.all(children.map((child) => child.close()));
      }
    } finally {
      await parent.close();
    }
    t.diagnostic('forked 2 children');
  });
});

describe('checkpoints', () => {
  it('restores a checkpoint in place, branches from it, and undoes a call', async () => {
    const box = await Sandbox.create({ template: 'python', ...service, autoCheckpoint: true });
    try {
      await box.runCode("state = ['kept']");
      const cp = await box.checkpoint('js');
      assert.equal(cp.label, 'js');
      assert.ok(cp.id.startsWith('cp_') && cp.bytes > 0);
      await box.runCode("state.append('lost')");
      assert.equal((await box.restore(cp)).id, cp.id);
      assert.equal((await box.runCode('state')).text, "['kept']");
      await box.runCode("state.append('undone')");
      const back = await box.undo();
      assert.ok(back.auto);
      assert.equal((await box.runCode('state')).text, "['kept']");
      const branch = await Sandbox.create({ ...service, checkpoint: cp });
      try {
        assert.equal((await branch.runCode('state')).text, "['kept']");
      } finally {
        await branch.close();
      }
      assert.ok((await box.checkpoints()).some((c) => c.id === cp.id));
      await box.deleteCheckpoint(cp);
      assert.ok(!(await box.checkpoints()).some((c) => c.id === cp.id));
    } finally {
      await box.close();
    }
  });
});

describe('kernelhost/ai-sdk with ai v7', () => {
  const usage = {
    inputTokens: { total: 1, noCache: 1, cacheRead: 0, cacheWrite: 0 },
    outputTokens: { total: 1, text: 1, reasoning: 0 },
  };
  const toolCall = (id: string, input: object) => ({
    content: [{ type: 'tool-call' as const, toolCallId: id, toolName: 'runCode', input: JSON.stringify(input) }],
    finishReason: { unified: 'tool-calls' as const, raw: 'tool_use' },
    usage,
    warnings: [],
  });

  it('generateText runs the tool in a sandbox it creates, keeps state across steps, and shows images', { timeout: 240_000 }, async () => {
    const runCode = kernelhostRunCode({ template: 'python', ...service });
    const model = new MockLanguageModelV4({
      doGenerate: [
        toolCall('c1', { code: 'x = 40' }),
        toolCall('c2', { code: 'x + 2' }),
        toolCall('c3', { code: SHOW_PNG }),
        toolCall('c4', { code: 'echo from-bash; exit 3', language: 'bash' }),
        {
          content: [{ type: 'text', text: 'The answer is 42.' }],
          finishReason: { unified: 'stop', raw: 'end_turn' },
          usage,
          warnings: [],
        },
      ],
    });
    try {
      const result = await generateText({
        model,
        tools: { runCode: aiTool(runCode) },
        stopWhen: isStepCount(6),
        prompt: 'What is 40 + 2?',
      });
      assert.equal(result.text, 'The answer is 42.');
      assert.equal(result.steps.length, 5);
      const outputs = result.steps.flatMap((step) => step.toolResults.map((r) => r.output as RunCodeOutput));
      assert.equal(outputs[1]!.text, 'Out[2]: 42');
      assert.equal(outputs[1]!.isError, false);
      assert.equal(outputs[2]!.images[0]!.mediaType, 'image/png');
      assert.equal(outputs[3]!.text, 'from-bash\n[exit code 3]');
      assert.equal(outputs[3]!.isError, true);
      // What the model was sent back: the text as a text output, the image as a file part.
      const toolMessages = (call: number) =>
        model.doGenerateCalls[call]!.prompt.filter((m) => m.role === 'tool').flatMap((m) => m.content);
      const second = toolMessages(2).at(-1) as { output: { type: string; value: unknown } };
      assert.deepEqual(second.output, { type: 'text', value: 'Out[2]: 42' });
      const third = toolMessages(3).at(-1) as { output: { type: string; value: Array<{ type: string; mediaType?: string }> } };
      assert.equal(third.output.type, 'content');
      assert.equal(third.output.value[1]!.type, 'file');
      assert.equal(third.output.value[1]!.mediaType, 'image/png');
      const created = await runCode.sandbox();
      assert.equal(created.info.template, 'python');
    } finally {
      await runCode.close();
    }
  });
});

describe('kernelhost/openai-agents with @openai/agents', () => {
  it('Runner runs the tool twice with state kept, and a failing cell does not end the run', async () => {
    setTracingDisabled(true);
    const interpreter = kernelhostCodeInterpreter({ sandbox: sbx });
    const model = new ScriptedModel([
      [functionCall('run_code', { code: 'total = 40', language: 'python' }, { callId: 'call_1' })],
      [functionCall('run_code', { code: 'total + 2', language: 'python' }, { callId: 'call_2' })],
      [functionCall('run_code', { code: 'raise ValueError("nope")', language: 'python' }, { callId: 'call_3' })],
      [assistantMessage('total is 42')],
    ]);
    const agent = new Agent({ name: 'calc', instructions: 'Use run_code.', model, tools: [agentsTool(interpreter)] });
    const result = await run(agent, 'what is 40 + 2?');
    assert.equal(result.finalOutput, 'total is 42');
    model.assertComplete();
    const outputOf = (call: number, callId: string) => {
      const item = (model.calls[call]!.request.input as Array<Record<string, unknown>>).find(
        (i) => i.type === 'function_call_result' && i.callId === callId,
      ) as { output: { type: string; text: string } };
      return item.output;
    };
    assert.equal(outputOf(2, 'call_2').type, 'text');
    assert.match(outputOf(2, 'call_2').text, /^Out\[\d+\]: 42$/);
    assert.match(outputOf(3, 'call_3').text, /ValueError: nope/);
    await interpreter.close(); // a passed-in sandbox is left open
    assert.equal((await sbx.runCode('total')).text, '40', 'the sandbox passed in stays open');
  });
});

describe('kernelhost/anthropic with @anthropic-ai/sdk', () => {
  type Turn = { content: Array<Record<string, unknown>>; stop_reason: string };
  const requests: Array<Record<string, unknown>> = [];
  let script: Turn[] = [];
  let url = '';
  const server = createServer((req: IncomingMessage, res: ServerResponse) => {
    let body = '';
    req.on('data', (chunk) => (body += chunk));
    req.on('end', () => {
      const payload = JSON.parse(body) as Record<string, unknown>;
      requests.push({ ...payload, authorization: req.headers.authorization });
      const turn = script.shift();
      if (req.url !== '/v1/messages' || !turn) {
        res.writeHead(500, { 'content-type': 'application/json' });
        res.end(JSON.stringify({ type: 'error', error: { type: 'api_error', message: `unscripted ${req.url}` } }));
        return;
      }
      res.writeHead(200, { 'content-type': 'application/json' });
      res.end(
        JSON.stringify({
          id: `msg_${requests.length}`,
          type: 'message',
          role: 'assistant',
          model: 'scripted',
          content: turn.content,
          stop_reason: turn.stop_reason,
          stop_sequence: null,
          usage: { input_tokens: 1, output_tokens: 1 },
        }),
      );
    });
  });

  before(async () => {
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  });
  after(() => new Promise<void>((resolve) => server.close(() => resolve())));

  it('the tool-use loop of the docs runs until end_turn, answering with tool_result blocks', async () => {
    script = [
      {
        content: [
          { type: 'text', text: 'Computing.' },
          { type: 'tool_use', id: 'toolu_1', name: 'run_python', input: { code: "y = 6 * 7\nprint('y is', y)" } },
          { type: 'tool_use', id: 'toolu_2', name: 'run_python', input: { code: SHOW_PNG } },
        ],
        stop_reason: 'tool_use',
      },
      { content: [{ type: 'tool_use', id: 'toolu_3', name: 'run_python', input: { code: 'y / 0' } }], stop_reason: 'tool_use' },
      { content: [{ type: 'text', text: 'y is 42.' }], stop_reason: 'end_turn' },
    ];
    const client = new Anthropic({ baseURL: url, apiKey: 'test-key', maxRetries: 0 });
    const messages: Anthropic.MessageParam[] = [{ role: 'user', content: 'What is 6 * 7?' }];
    for (;;) {
      const response = await client.messages.create({
        model: 'scripted',
        max_tokens: 1024,
        tools: [codeExecutionTool()],
        messages,
      });
      messages.push({ role: 'assistant', content: response.content });
      if (response.stop_reason !== 'tool_use') break;
      const results: Anthropic.ToolResultBlockParam[] = [];
      for (const block of response.content) {
        if (block.type === 'tool_use') {
          results.push((await handleCodeExecutionToolUse(block, sbx)) as unknown as Anthropic.ToolResultBlockParam);
        }
      }
      messages.push({ role: 'user', content: results });
    }
    assert.equal(requests.length, 3);
    assert.equal(requests[0]!.authorization, 'Bearer test-key');
    const firstAnswers = (requests[1]!.messages as Anthropic.MessageParam[]).at(-1)!.content as unknown as Array<Record<string, unknown>>;
    assert.deepEqual(firstAnswers[0], {
      type: 'tool_result',
      tool_use_id: 'toolu_1',
      content: [{ type: 'text', text: 'y is 42' }],
      is_error: false,
    });
    const image = (firstAnswers[1]!.content as Array<Record<string, unknown>>)[1]!;
    assert.deepEqual(Object.keys(image), ['type', 'source']);
    assert.equal((image.source as Record<string, unknown>).media_type, 'image/png');
    const lastAnswer = ((requests[2]!.messages as Anthropic.MessageParam[]).at(-1)!.content as unknown as Array<Record<string, unknown>>)[0]!;
    assert.equal(lastAnswer.is_error, true);
    assert.match(JSON.stringify(lastAnswer.content), /ZeroDivisionError/);
  });

  it('answers the 20250825 server tool shapes with their own result blocks and error codes', async () => {
    const answer = (name: string, input: object, id = 'srvtoolu_1') =>
      handleCodeExecutionToolUse({ type: 'server_tool_use', id, name, input }, sbx, { timeoutSeconds: 5 });
    assert.deepEqual(await answer('bash_code_execution', { command: 'echo hi; echo oops >&2; exit 2' }), {
      type: 'bash_code_execution_tool_result',
      tool_use_id: 'srvtoolu_1',
      content: { type: 'bash_code_execution_result', stdout: 'hi\n', stderr: 'oops\n', return_code: 2, content: [] },
    });
    assert.deepEqual((await answer('bash_code_execution', {})).content, {
      type: 'bash_code_execution_tool_result_error',
      error_code: 'invalid_tool_input',
    });
    assert.deepEqual((await answer('text_editor_code_execution', { command: 'create', path: '/tmp/js/e.py', file_text: 'a = 1\nb = 2\n' })).content, {
      type: 'text_editor_code_execution_create_result',
      is_file_update: false,
    });
    assert.deepEqual(
      (await answer('text_editor_code_execution', { command: 'str_replace', path: '/tmp/js/e.py', old_str: 'b = 2', new_str: 'b = 3\nc = 4' })).content,
      {
        type: 'text_editor_code_execution_str_replace_result',
        old_start: 2,
        old_lines: 1,
        new_start: 2,
        new_lines: 2,
        lines: ['-b = 2', '+b = 3', '+c = 4'],
      },
    );
    assert.deepEqual((await answer('text_editor_code_execution', { command: 'view', path: '/tmp/js/e.py' })).content, {
      type: 'text_editor_code_execution_view_result',
      file_type: 'text',
      content: 'a = 1\nb = 3\nc = 4\n',
      num_lines: 3,
      start_line: 1,
      total_lines: 3,
    });
    assert.deepEqual((await answer('text_editor_code_execution', { command: 'view', path: '/tmp/js/none' })).content, {
      type: 'text_editor_code_execution_tool_result_error',
      error_code: 'file_not_found',
      error_message: '/tmp/js/none does not exist',
    });
    assert.deepEqual((await answer('code_execution', { code: 'import time; time.sleep(30)' })).content, {
      type: 'code_execution_tool_result_error',
      error_code: 'execution_time_exceeded',
    });
    await assert.rejects(
      handleCodeExecutionToolUse({ type: 'text', text: 'hi' }, sbx),
      /is not a tool call/,
    );
    // A closed sandbox is the developer's mistake: it throws instead of becoming an answer.
    const closed = await Sandbox.create({ ...service });
    await closed.close();
    await assert.rejects(
      handleCodeExecutionToolUse({ type: 'tool_use', id: 'toolu_x', name: 'run_python', input: { code: '1' } }, closed),
      KernelHostError,
    );
  });
});
