/**
 * Errors thrown by the kernelhost client, split by cause (the same tree as the Python SDK):
 *
 * ```
 * KernelHostError                 any error of the client (misuse, e.g. a closed sandbox)
 *  ├── APIError                   the server answered with an error (.status, .code)
 *  │    ├── AuthenticationError   401, or no API key was given
 *  │    ├── InvalidRequestError   400 / 422: the request was rejected as malformed
 *  │    ├── NotFoundError         404: no such sandbox (or another key's)
 *  │    ├── ConflictError         409: the sandbox is in the wrong state for this call
 *  │    ├── RateLimitError        429: too many sandboxes or requests
 *  │    └── ServerError           5xx: the service failed
 *  ├── TransportError             no usable answer: unreachable, dropped, unparseable
 *  └── KernelHostTimeout          a client-side deadline passed
 * ```
 *
 * Code that fails *in the sandbox* does not throw: see `Execution.error`.
 */

export class KernelHostError extends Error {
  override name = 'KernelHostError';
}

export class APIError extends KernelHostError {
  override name = 'APIError';
  /** The HTTP status, or null when the client refused to send the request. */
  readonly status: number | null;
  /** The server's snake_case error code. */
  readonly code: string;
  /** The whole `error` object the server sent. */
  readonly details: Record<string, unknown>;

  constructor(message: string, status: number | null, code: string, details: Record<string, unknown> = {}) {
    super(status === null ? message : `${message} (HTTP ${status} ${code})`);
    this.status = status;
    this.code = code;
    this.details = details;
  }
}

export class AuthenticationError extends APIError {
  override name = 'AuthenticationError';
}
export class InvalidRequestError extends APIError {
  override name = 'InvalidRequestError';
}
export class NotFoundError extends APIError {
  override name = 'NotFoundError';
}
export class ConflictError extends APIError {
  override name = 'ConflictError';
}
export class RateLimitError extends APIError {
  override name = 'RateLimitError';
}
export class ServerError extends APIError {
  override name = 'ServerError';
}
export class TransportError extends KernelHostError {
  override name = 'TransportError';
}
export class KernelHostTimeout extends KernelHostError {
  override name = 'KernelHostTimeout';
}

/** The error for an HTTP error response, from its status and `{"error": {...}}` body. */
export function errorForStatus(status: number, body: unknown, request: string): APIError {
  const error =
    typeof body === 'object' && body !== null && 'error' in body && typeof body.error === 'object' && body.error
      ? (body.error as Record<string, unknown>)
      : {};
  const code = typeof error.code === 'string' ? error.code : 'http_error';
  const message =
    typeof error.message === 'string' ? error.message : `${request} failed with HTTP ${status}`;
  const Kind =
    status === 401
      ? AuthenticationError
      : status === 400 || status === 422
        ? InvalidRequestError
        : status === 404
          ? NotFoundError
          : status === 409
            ? ConflictError
            : status === 429
              ? RateLimitError
              : status >= 500
                ? ServerError
                : APIError;
  return new Kind(message, status, code, error);
}
