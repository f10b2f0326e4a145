/**
 * Tests that need no service: output shaping, the kernel-call wire format, and that the adapters
 * type-check and convert with the frameworks' own `tool()` (the compile step of these tests is
 * itself a check: a v4-style `parameters` or a wrong field would not compile).
 */

import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import { tool as agentsTool } from '@openai/agents';
import { asSchema, tool as aiTool } from 'ai';
import { DEFAULT_BUDGET, MIN_MAX_CHARS, Sandbox, fitTexts, outputBudget, shapeExecution, truncateText } from 'kernelhost';
import { codeExecutionTool, serverCodeExecutionTool } from 'kernelhost/anthropic';
import { inputSchema, kernelhostRunCode } from 'kernelhost/ai-sdk';
import { PARAMETERS, kernelhostCodeInterpreter } from 'kernelhost/openai-agents';

import { executionOf } from './helpers.js';

describe('truncateText', () => {
  it('returns text that fits unchanged', () => {
    assert.equal(truncateText('abc', 100), 'abc');
  });

  it('keeps head and tail around a marker and never exceeds the budget', () => {
    const text = Array.from({ length: 5000 }, (_, i) => `line ${i}`).join('\n');
    for (const max of [100, 101, 150, 999, 1000, 1001, 4096]) {
      const out = truncateText(text, max);
      assert.ok(out.length <= max, `${out.length} > ${max}`);
      assert.ok(out.length >= max - 1);
      assert.ok(out.startsWith('line 0'));
      assert.ok(out.endsWith('line 4999'));
      const omitted = Number(/\[\.\.\. (\d+) of (\d+) characters truncated \.\.\.\]/.exec(out)?.[1]);
      const marker = /\n\[\.\.\. \d+ of \d+ characters truncated \.\.\.\]\n/.exec(out)![0];
      assert.equal(omitted, text.length - (out.length - marker.length));
    }
  });

  it('honours headFraction', () => {
    const text = 'h'.repeat(500) + 't'.repeat(500);
    assert.ok(truncateText(text, 200, 1).endsWith('truncated ...]\n'));
    assert.ok(truncateText(text, 200, 0).startsWith('\n[...'));
  });

  it('uses a short marker, then a plain cut, for tiny limits', () => {
    const text = 'x'.repeat(1000);
    assert.match(truncateText(text, 40), /^x+\[\.\.\.\d+ cut\.\.\.\]x+$/);
    assert.equal(truncateText(text, 40).length, 40);
    assert.equal(truncateText(text, 5), 'xxxxx');
  });
});

describe('fitTexts and outputBudget', () => {
  it('lets short texts keep everything and shares the rest', () => {
    const [out, cut] = fitTexts(['short', 'y'.repeat(10_000), 'z'.repeat(10_000)], 1000);
    assert.equal(out[0], 'short');
    assert.ok(cut);
    assert.ok(out.reduce((n, t) => n + t.length, 0) <= 1000);
    assert.ok(out[1]!.length >= 490 && out[2]!.length >= 490);
  });

  it('rejects budgets too small for the marker, naming the fix', () => {
    assert.throws(() => outputBudget({ maxChars: MIN_MAX_CHARS - 1 }), /maxChars=99: use an integer of at least 100/);
    assert.throws(() => outputBudget({ headFraction: 2 }), /headFraction=2/);
    assert.equal(outputBudget({ maxChars: 500 }).maxChars, 500);
  });
});

describe('shapeExecution', () => {
  it('renders stdout, stderr, the value, the traceback (without ANSI) and notes', () => {
    const execution = executionOf({
      stdout: 'out\n',
      stderr: 'warn\n',
      results: [
        { data: { 'text/html': '<b>x</b>', 'text/plain': 'X' }, metadata: {}, isMainResult: false, displayId: null, isUpdate: false },
        { data: { 'text/plain': '42' }, metadata: {}, isMainResult: true, displayId: null, isUpdate: false },
      ],
      error: { name: 'ValueError', value: 'bad', traceback: ['\u001b[31mTraceback\u001b[0m', 'ValueError: bad'] },
      executionCount: 3,
      status: 'error',
    });
    const shaped = shapeExecution(execution);
    assert.equal(shaped.toText(), 'out\n[stderr]\nwarn\nX\nOut[3]: 42\nTraceback\nValueError: bad');
    assert.equal(shaped.toText({ stderr: false }), 'out\nX\nOut[3]: 42\nTraceback\nValueError: bad');
    assert.ok(shaped.isError);
  });

  it('splits images out within the image budget', () => {
    const image = { data: { 'image/png': 'iVBORw0K\nGgo=', 'text/plain': '<Figure>' }, metadata: {}, isMainResult: false, displayId: null, isUpdate: false };
    const shaped = shapeExecution(executionOf({ results: [image, image, image] }), { ...DEFAULT_BUDGET, maxImages: 2 });
    assert.deepEqual(shaped.images, [
      { mimeType: 'image/png', data: 'iVBORw0KGgo=' },
      { mimeType: 'image/png', data: 'iVBORw0KGgo=' },
    ]);
    assert.match(shaped.toText(), /<image 1: image\/png, attached>\n<image 2: image\/png, attached>\n<image: image\/png, not attached>\n\[1 more image/);
  });

  it('says when the code timed out', () => {
    assert.match(shapeExecution(executionOf({ status: 'timeout' })).toText(), /^\[timed out: /);
    assert.equal(shapeExecution(executionOf({})).toText(), '[no output]');
  });
});

describe('adapter definitions', () => {
  it('anthropic tool definitions', () => {
    assert.deepEqual(codeExecutionTool().input_schema.required, ['code']);
    assert.deepEqual(serverCodeExecutionTool(), { type: 'code_execution_20250825', name: 'code_execution' });
    assert.throws(() => serverCodeExecutionTool('latest'), /use a date such as '20250825'/);
  });

  it('ai-sdk: tool() accepts the parts and derives a strict JSON schema; validation names the field', async () => {
    const runCode = kernelhostRunCode({ sandbox: {} as Sandbox });
    const t = aiTool(runCode);
    assert.equal(t.description, runCode.description);
    const schema = asSchema(t.inputSchema);
    assert.deepEqual(await schema.jsonSchema, {
      type: 'object',
      properties: {
        code: { type: 'string', description: 'Python source, or a bash command' },
        language: { type: 'string', enum: ['python', 'bash'], description: '"python" (default: the kernel) or "bash" (a shell command)' },
      },
      required: ['code'],
      additionalProperties: false,
    });
    assert.deepEqual(await schema.validate!({ code: '1' }), { success: true, value: { code: '1' } });
    const bad = await schema.validate!({ code: 1, language: 'ruby' });
    assert.equal(bad.success, false);
    assert.deepEqual(inputSchema['~standard'].validate({ code: 'x', extra: 1 }).issues?.[0]?.message, 'unknown property "extra"');
  });

  it('openai-agents: tool() accepts the parts as a strict function tool', () => {
    const interpreter = kernelhostCodeInterpreter({ sandbox: {} as Sandbox });
    const t = agentsTool(interpreter);
    assert.equal(t.type, 'function');
    assert.equal(t.name, 'run_code');
    assert.equal(t.strict, true);
    assert.deepEqual(t.parameters, PARAMETERS);
  });
});
